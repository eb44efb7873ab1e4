"""What the Kubernetes backend applies for a deployment, as plain manifests (dicts): a
Secret holding its engine key, an apps/v1 Deployment running vLLM's OpenAI server, a
headless Service, a PodDisruptionBudget, a NetworkPolicy, a PodMonitor when asked, and,
when the deployment asks for native scaling, an autoscaling/v2 HorizontalPodAutoscaler or
a KEDA ScaledObject. Every object is named by `object_name` and selects by the
deployment's name and the install (`owner_labels`), never by a database id.

Pure functions of the Backend's configuration and the Deployment record: the same inputs
give the same manifests, which is what server-side apply and a no-change resync need.
`manage.py render_manifests <deployment>` prints them as YAML.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from controlplane.backends.base import BackendConfigError
from controlplane.backends.k8s_config import (
    SCALING,
    KubernetesConfig,
    check_allowed,
    rollout_size,
)
from controlplane.backends.k8s_names import (
    FIELD_MANAGER,
    GENERATION_ANNOTATION,
    INSTALL_LABEL,
    INSTANCE_LABEL,
    ROLE_LABEL,
    deployment_key,
    engine_key_secret_name,
    install_id,
    managed_labels,
    object_name,
    owner_labels,
    selector_changed,
)
from controlplane.backends.k8s_pod_spec import (
    ENGINE_KEY_ENV,
    PORT,
    pod_spec,
)

if TYPE_CHECKING:
    from controlplane.models import Deployment

# Imported from here by the backend, the render_manifests command, the pod mapping, the
# client and their tests.
__all__ = ["FIELD_MANAGER", "GENERATION_ANNOTATION", "INSTALL_LABEL", "INSTANCE_LABEL", "PORT",
           "ROLE_LABEL", "SCALING", "KubernetesConfig", "check_allowed", "deployment_key",
           "managed_labels", "object_name", "owner_labels", "render", "selector_changed",
           "to_yaml"]

# Running + waiting requests per pod native scaling aims at, unless the deployment's
# autoscaling policy has a `queue_per_replica` target (docs/autoscaling.md).
DEFAULT_NATIVE_TARGET = 16.0
# The metric name the HPA reads; a Prometheus adapter rule makes it (docs/autoscaling.md).
HPA_METRIC = "vllm_requests_running_and_waiting"
COLD_START_METRIC = "fleetplane_gateway_cold_start_waiting_requests"


def metadata(deployment: Deployment, config: KubernetesConfig, name: str) -> dict[str, Any]:
    """An object's name, namespace and labels (the config's extra labels, then the
    owner labels)."""
    return {"name": name, "namespace": config.namespace,
            "labels": {**config.extra_labels, **owner_labels(deployment)}}


def render(deployment: Deployment, config: KubernetesConfig, scaling: str = "",
           replicas: int | None = None) -> list[dict[str, Any]]:
    """Every object the backend applies for this deployment, in apply order.

    `scaling` (default: the configuration's) `hpa` or `keda` adds Kubernetes' own scaling
    on running + waiting requests and leaves `spec.replicas` out, so the two never fight
    over it; `controlplane` sets `replicas` (default: the desired active count plus the
    warm standby pool). New pods are labelled `active`, but take no traffic before the
    control plane has seen them ready and warmed them up; it then relabels the ones beyond
    the desired active count `standby` (the same template for every pod: a change of the
    standby count restarts nothing)."""
    scaling = scaling or config.scaling
    if scaling not in SCALING:
        raise BackendConfigError("scaling", f"one of {', '.join(SCALING)}")
    if deployment.deleting or deployment.state != deployment.State.RUNNING:
        scaling = "controlplane"  # stopped or deleting: no autoscaler, no pods
    spec: dict[str, Any] = {}
    if scaling == "controlplane":
        spec["replicas"] = (deployment.desired_replicas() + deployment.desired_standby()
                            if replicas is None else replicas)
    objects: list[dict[str, Any]] = [
        engine_key_secret(deployment, config),
        workload(deployment, config, spec),
        service(deployment, config),
        disruption_budget(deployment, config),
        network_policy(deployment, config),
    ]
    if config.pod_monitor:
        objects.append(pod_monitor(deployment, config))
    if scaling == "hpa":
        objects.append(hpa(deployment, config))
    elif scaling == "keda":
        objects.append(scaled_object(deployment, config))
    return objects


def workload(deployment: Deployment, config: KubernetesConfig, spec: dict[str, Any]
             ) -> dict[str, Any]:
    """The apps/v1 Deployment of vLLM pods; `spec` holds `replicas` when the control
    plane sets the count."""
    selector = owner_labels(deployment)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {
            **spec,
            "selector": {"matchLabels": selector},
            # Default one pod at a time, never below the desired count (a GPU pod is
            # slow to start and expensive to lose); a full GPU pool needs max_surge 0
            # and max_unavailable 1 or more.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": config.max_surge,
                                           "maxUnavailable": config.max_unavailable}},
            "template": {
                "metadata": {
                    "labels": {**config.extra_labels, **selector, ROLE_LABEL: "active"},
                    "annotations": {GENERATION_ANNOTATION: str(deployment.generation)}},
                "spec": pod_spec(deployment, config),
            },
        },
    }


def service(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """The headless Service: its endpoints are the pods."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"clusterIP": "None", "selector": owner_labels(deployment),
                 "publishNotReadyAddresses": False,
                 "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                            "protocol": "TCP"}]},
    }


def disruption_budget(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """The PodDisruptionBudget: evictions (node drains) may take as many pods at once as
    a rollout does, and at least one: a budget of 0 would block every drain."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"maxUnavailable": config.max_unavailable if rollout_size(
                     config.max_unavailable) else 1,
                 "selector": {"matchLabels": owner_labels(deployment)}},
    }


def engine_key_secret(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """The deployment's engine key, as the Secret its pods read it from (applied first,
    so no pod starts without it)."""
    key = base64.b64encode(deployment.engine_key().encode()).decode()
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": metadata(deployment, config, engine_key_secret_name(deployment)),
        "data": {ENGINE_KEY_ENV: key},
    }


def network_policy(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Only the gateway and the controllers (and Prometheus, where its labels are set)
    reach the replica port: the engine key is one lock, this is the second, and it also
    covers /metrics and /health, which vLLM serves without a key."""
    from django.conf import settings

    def peer(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": namespace}},
                "podSelector": {"matchLabels": dict(labels)}}

    namespace = settings.KUBERNETES_CONTROL_PLANE_NAMESPACE
    peers = [peer(namespace, settings.KUBERNETES_GATEWAY_POD_LABELS),
             peer(namespace, settings.KUBERNETES_CONTROLLER_POD_LABELS)]
    if settings.KUBERNETES_PROMETHEUS_POD_LABELS:
        peers.append(peer(settings.KUBERNETES_PROMETHEUS_NAMESPACE,
                          settings.KUBERNETES_PROMETHEUS_POD_LABELS))
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"podSelector": {"matchLabels": owner_labels(deployment)},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": PORT}]}]},
    }


def pod_monitor(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """A Prometheus Operator PodMonitor for the pods' /metrics (Prometheus must also be
    admitted by the NetworkPolicy: KUBERNETES_PROMETHEUS_POD_LABELS)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"selector": {"matchLabels": owner_labels(deployment)},
                 "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}],
                 # The series then say which deployment and install they belong to.
                 "podTargetLabels": [INSTANCE_LABEL, INSTALL_LABEL]},
    }


def native_target(deployment: Deployment) -> float:
    """Running + waiting requests per pod that native scaling aims at: the deployment's
    `queue_per_replica` target (requests in flight per replica) when its policy has one."""
    for signal in (deployment.autoscaling or {}).get("signals") or []:
        if signal.get("name") == "queue_per_replica":
            return float(signal["target"])
    return DEFAULT_NATIVE_TARGET


def wakes_from_zero(deployment: Deployment, config: KubernetesConfig) -> bool:
    """Whether a request can bring this deployment back from zero pods: the gateway holds
    requests for it (its autoscaling policy is enabled) and Prometheus scrapes the count."""
    return config.gateway_scraped and bool((deployment.autoscaling or {}).get("enabled"))


def number(value: float) -> str:
    """A target as Kubernetes reads it (no trailing `.0`)."""
    return f"{value:g}"


def hpa(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling on running + waiting requests per pod (a Prometheus adapter rule
    serves HPA_METRIC as a pods metric: docs/autoscaling.md). An HPA does not scale to
    zero, so at least one pod."""
    name = object_name(deployment.name)
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(deployment, config, name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": max(1, deployment.min_replicas),
            "maxReplicas": max(1, deployment.max_replicas, deployment.min_replicas),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": HPA_METRIC},
                "target": {"type": "AverageValue",
                           "averageValue": number(native_target(deployment))}}}],
        },
    }


def scaled_object(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling through KEDA's Prometheus scaler on running + waiting requests, with
    the HPA's target. To zero only when a request can wake it: then a second trigger on
    the requests the gateway holds for it activates the deployment at the first one."""
    from django.conf import settings

    # The pods' own labels (PodMonitor's podTargetLabels, or a scrape config relabelling
    # them the same way): another deployment or install serving the same model name in
    # this namespace is not counted.
    where = (f'namespace="{config.namespace}",'
             f'model_name="{deployment.served_model_name()}",'
             f'{prometheus_label(INSTANCE_LABEL)}="{object_name(deployment.name)}",'
             f'{prometheus_label(INSTALL_LABEL)}="{install_id()}"')
    load = (f"(sum(vllm:num_requests_running{{{where}}}) or vector(0)) + "
            f"(sum(vllm:num_requests_waiting{{{where}}}) or vector(0))")
    target = number(native_target(deployment))
    triggers: list[dict[str, Any]] = [{"type": "prometheus", "metadata": {
        "serverAddress": config.prometheus_address, "query": load, "threshold": target}}]
    wakes = wakes_from_zero(deployment, config)
    if wakes:
        held = (f'sum({COLD_START_METRIC}{{namespace='
                f'"{settings.KUBERNETES_CONTROL_PLANE_NAMESPACE}",'
                f'deployment="{deployment.name}"}}) or vector(0)')
        triggers.append({"type": "prometheus", "metadata": {
            "serverAddress": config.prometheus_address, "query": held,
            "threshold": target, "activationThreshold": "0"}})
    name = object_name(deployment.name)
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": metadata(deployment, config, name),
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": deployment.min_replicas if wakes else max(
                1, deployment.min_replicas),
            "maxReplicaCount": max(1, deployment.max_replicas, deployment.min_replicas),
            "triggers": triggers,
        },
    }


def prometheus_label(label: str) -> str:
    """A Kubernetes label's name as Prometheus carries it (`app.kubernetes.io/instance`
    becomes `app_kubernetes_io_instance`)."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in label)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as YAML for a person to read: a Secret's values are left out (the
    engine key is never shown after it is made; the control plane applies it itself)."""
    import yaml

    shown = [{**{k: v for k, v in obj.items() if k != "data"},
              "stringData": dict.fromkeys(obj.get("data") or {}, "(hidden: applied by the "
                                                                 "control plane)")}
             if obj["kind"] == "Secret" else obj for obj in objects]
    return "".join("---\n" + yaml.safe_dump(obj, sort_keys=False) for obj in shown)
