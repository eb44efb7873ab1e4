"""What the Kubernetes backend applies for a deployment, as plain manifests (dicts): a
Secret holding its engine key, an apps/v1 Deployment running vLLM's OpenAI server, a
headless Service, a PodDisruptionBudget, a NetworkPolicy, and, when the deployment asks
for native scaling, an autoscaling/v2 HorizontalPodAutoscaler or a KEDA ScaledObject.

Pure functions of the Backend's configuration and the Deployment record: the same inputs
give the same manifests, which is what server-side apply and a no-change resync need.
`manage.py render_manifests <deployment>` prints them as YAML.
"""

from __future__ import annotations

import base64
import posixpath
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.backends.base import BackendConfigError

if TYPE_CHECKING:
    from controlplane.models import Deployment

FIELD_MANAGER = "fleetplane"
MANAGED_BY = "fleetplane"
APP_NAME = "vllm"
ID_LABEL = "fleetplane.io/deployment-id"
ROLE_LABEL = "fleetplane.io/role"
# On the pod template: a new generation (changed engine args, a restart) rolls the pods.
GENERATION_ANNOTATION = "fleetplane.io/generation"
PORT = 8000
MODELS_MOUNT = "/models"
# vLLM reads its --api-key from this variable; the pod takes it from the Secret.
ENGINE_KEY_ENV = "VLLM_API_KEY"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
MODEL_SOURCES = ("pvc", "hostPath", "download")
SCALING = ("controlplane", "hpa", "keda")


@dataclass(frozen=True)
class KubernetesConfig:
    """A kubernetes Backend's `config`, checked."""

    namespace: str
    kubeconfig: str = ""
    context: str = ""
    in_cluster: bool = False
    image: str = "vllm/vllm-openai"
    image_tag: str = "latest"
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str = ""
    gpu_product: str = ""
    tolerations: tuple[dict[str, Any], ...] = (
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)
    cpu: str = "4"
    memory: str = "16Gi"
    shm_size: str = "2Gi"
    model_source: str = "download"
    pvc_name: str = ""
    host_path: str = ""
    hf_token_secret: str = ""
    startup_seconds: int = 1800
    termination_grace_seconds: int = 120
    prometheus_address: str = "http://prometheus.monitoring:9090"
    extra_labels: dict[str, str] = field(default_factory=dict)
    #: Who sets the replica count: the control plane (default), or Kubernetes itself
    #: through an HPA or a KEDA ScaledObject on waiting requests.
    scaling: str = "controlplane"
    #: Send each new pod one real request before it takes traffic. Needs the control
    #: plane to reach pod IPs (it does when it runs in the cluster).
    warm_up: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, allow_lists: bool = True) -> KubernetesConfig:
        """Check a config. `allow_lists=False` (a config already stored, read to run it)
        leaves the install's allow-lists to `apply`, which reports a refusal on the
        deployment instead of failing every reconcile pass."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BackendConfigError(unknown[0], f"unknown setting; known: "
                                                 f"{', '.join(sorted(known))}")
        namespace = raw.get("namespace")
        if not isinstance(namespace, str) or not DNS_LABEL.match(namespace):
            raise BackendConfigError("namespace", "required: a DNS label such as `inference`")
        values: dict[str, Any] = {"namespace": namespace}
        for name in ("kubeconfig", "context", "image", "image_tag", "service_account",
                     "gpu_product", "pvc_name", "host_path", "hf_token_secret",
                     "prometheus_address"):
            if name in raw:
                if not isinstance(raw[name], str):
                    raise BackendConfigError(name, "must be a string")
                values[name] = raw[name]
        for name in ("in_cluster", "warm_up"):
            if name in raw:
                if not isinstance(raw[name], bool):
                    raise BackendConfigError(name, "must be true or false")
                values[name] = raw[name]
        if "scaling" in raw:
            if raw["scaling"] not in SCALING:
                raise BackendConfigError("scaling", f"one of {', '.join(SCALING)}")
            values["scaling"] = raw["scaling"]
        for name in ("cpu", "memory", "shm_size"):
            if name in raw:
                value = raw[name]
                if not isinstance(value, str | int) or not QUANTITY.match(str(value)):
                    raise BackendConfigError(name, "must be a Kubernetes quantity such as "
                                                   "`8`, `500m` or `32Gi`")
                values[name] = str(value)
        for name, low in (("startup_seconds", 60), ("termination_grace_seconds", 10)):
            if name in raw:
                value = raw[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < low:
                    raise BackendConfigError(name, f"must be a whole number of at least {low}")
                values[name] = value
        if "image_pull_secrets" in raw:
            secrets = raw["image_pull_secrets"]
            if not isinstance(secrets, list) or not all(
                    isinstance(s, str) and DNS_LABEL.match(s) for s in secrets):
                raise BackendConfigError("image_pull_secrets", "must be a list of Secret names")
            values["image_pull_secrets"] = tuple(secrets)
        if "tolerations" in raw:
            tolerations = raw["tolerations"]
            if not isinstance(tolerations, list) or not all(isinstance(t, dict)
                                                            for t in tolerations):
                raise BackendConfigError("tolerations", "must be a list of tolerations")
            values["tolerations"] = tuple(tolerations)
        if "extra_labels" in raw:
            labels = raw["extra_labels"]
            if not isinstance(labels, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
                raise BackendConfigError("extra_labels", "must map strings to strings")
            values["extra_labels"] = dict(labels)
        source = raw.get("model_source", "download")
        if source not in MODEL_SOURCES:
            raise BackendConfigError("model_source", f"one of {', '.join(MODEL_SOURCES)}")
        values["model_source"] = source
        if source == "pvc" and not values.get("pvc_name"):
            raise BackendConfigError("pvc_name", "required with model_source `pvc`: the "
                                                 "PersistentVolumeClaim holding the models")
        if source == "hostPath" and not str(values.get("host_path", "")).startswith("/"):
            raise BackendConfigError("host_path", "required with model_source `hostPath`: "
                                                  "an absolute path on the nodes")
        if allow_lists:
            check_allowed(values)
        return cls(**values)

    def as_dict(self) -> dict[str, object]:
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in asdict(self).items()}


def check_allowed(values: dict[str, Any]) -> None:
    """What this install's settings allow (docs/security.md): the image, the node path a
    pod may mount, the service account. An admin key configures within these bounds."""
    from django.conf import settings

    image = str(values.get("image", KubernetesConfig.image))
    tag = str(values.get("image_tag", KubernetesConfig.image_tag))
    allowed = set(settings.KUBERNETES_ALLOWED_IMAGES)
    if image not in allowed and f"{image}:{tag}" not in allowed:
        raise BackendConfigError("image", f"{image}:{tag} is not an image this install "
                                          f"allows (KUBERNETES_ALLOWED_IMAGES)")
    host_path = str(values.get("host_path", ""))
    if host_path:
        path = posixpath.normpath(host_path)
        if ".." in host_path.split("/") or not any(
                path == prefix or path.startswith(prefix.rstrip("/") + "/")
                for prefix in settings.KUBERNETES_ALLOWED_HOST_PATHS):
            raise BackendConfigError("host_path", f"{host_path!r} is not under a node path "
                                                  f"this install allows "
                                                  f"(KUBERNETES_ALLOWED_HOST_PATHS)")
    account = str(values.get("service_account", ""))
    if account and account not in settings.KUBERNETES_ALLOWED_SERVICE_ACCOUNTS:
        raise BackendConfigError("service_account", f"{account!r} is not a service account "
                                                    f"this install allows "
                                                    f"(KUBERNETES_ALLOWED_SERVICE_ACCOUNTS)")


def gpus_for(deployment: Deployment) -> int:
    args = deployment.engine_args or {}
    return int(args.get("tensor_parallel_size") or 1) * int(
        args.get("pipeline_parallel_size") or 1)


def owner_labels(deployment: Deployment) -> dict[str, str]:
    """The labels every object made for a deployment carries, and selects by."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": deployment.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        ID_LABEL: str(deployment.pk),
    }


def model_argument(deployment: Deployment, config: KubernetesConfig) -> str:
    """What `--model` names inside the pod."""
    model = deployment.model
    if config.model_source == "download":
        if model.source != "huggingface":
            raise BackendConfigError(
                "model_source", f"the model {model.name} is not a Hugging Face id, so pods "
                                f"cannot download it: use model_source `pvc` or `hostPath`")
        return str(model.source_uri)
    return f"{MODELS_MOUNT}/{model.name}"


def container(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    from controlplane.engine_args import engine_command_line

    gpus = gpus_for(deployment)
    args = engine_command_line(deployment.engine_args or {},
                               model_path=model_argument(deployment, config),
                               served_name=deployment.served_model_name(), port=PORT,
                               host="0.0.0.0")
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        # vLLM then refuses /v1/* without `Authorization: Bearer <key>`.
        {"name": ENGINE_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": engine_key_secret_name(deployment), "key": ENGINE_KEY_ENV}}},
    ]
    if config.model_source == "download":
        env.append({"name": "HF_HOME", "value": f"{MODELS_MOUNT}/.hf"})
        if config.hf_token_secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": config.hf_token_secret, "key": "HF_TOKEN"}}})
    else:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    limits: dict[str, str] = {"cpu": config.cpu, "memory": config.memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "name": "vllm",
        "image": f"{config.image}:{config.image_tag}",
        "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "models", "mountPath": MODELS_MOUNT}],
        # Loading a large model takes long: the startup probe allows startup_seconds;
        # readiness takes the pod out of the Service's endpoints, liveness restarts it.
        "startupProbe": {**probe, "periodSeconds": 10,
                         "failureThreshold": max(1, config.startup_seconds // 10)},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4,
                          "timeoutSeconds": 5},
        # The Service stops sending new requests first; in-flight ones get this long.
        "lifecycle": {"preStop": {"sleep": {"seconds": min(
            30, max(5, config.termination_grace_seconds // 4))}}},
        # Pod Security "baseline" and the parts of "restricted" vLLM can meet (it runs as
        # root in the official image, so runAsNonRoot is left to the image's owner).
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def pod_spec(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    models: dict[str, Any]
    if config.model_source == "pvc":
        models = {"name": "models", "persistentVolumeClaim": {"claimName": config.pvc_name}}
    elif config.model_source == "hostPath":
        models = {"name": "models", "hostPath": {"path": config.host_path,
                                                 "type": "Directory"}}
    else:
        models = {"name": "models", "emptyDir": {}}
    spec: dict[str, Any] = {
        "containers": [container(deployment, config)],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                 "sizeLimit": config.shm_size}}, models],
        "terminationGracePeriodSeconds": config.termination_grace_seconds,
        "tolerations": [dict(t) for t in config.tolerations],
        "enableServiceLinks": False,
        # vLLM never calls the Kubernetes API: a token in the pod is only something to steal.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    if config.gpu_product:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "nvidia.com/gpu.product", "operator": "In",
                "values": [config.gpu_product]}]}]}}}
    if config.service_account:
        spec["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    return spec


def metadata(deployment: Deployment, config: KubernetesConfig, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": config.namespace,
            "labels": {**config.extra_labels, **owner_labels(deployment)}}


def render(deployment: Deployment, config: KubernetesConfig, scaling: str = "",
           replicas: int | None = None) -> list[dict[str, Any]]:
    """Every object the backend applies for this deployment, in apply order.

    `scaling` (default: the configuration's) `hpa` or `keda` adds Kubernetes' own scaling
    on waiting requests and leaves `spec.replicas` out, so the two never fight over it;
    `controlplane` sets `replicas` (default: the desired active count plus the warm
    standby pool). New pods are labelled `active`, but take no traffic before the control
    plane has seen them ready and warmed them up; it then relabels the ones beyond the
    desired active count `standby` (the same template for every pod: a change of the
    standby count restarts nothing)."""
    scaling = scaling or config.scaling
    if scaling not in SCALING:
        raise BackendConfigError("scaling", f"one of {', '.join(SCALING)}")
    if not deployment.desired_replicas() + deployment.desired_standby():
        scaling = "controlplane"  # stopped, deleting or at zero: no autoscaler, no pods
    selector = owner_labels(deployment)
    spec: dict[str, Any] = {}
    if scaling == "controlplane":
        spec["replicas"] = (deployment.desired_replicas() + deployment.desired_standby()
                            if replicas is None else replicas)
    objects: list[dict[str, Any]] = [
        engine_key_secret(deployment, config),
        {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(deployment, config, deployment.name),
            "spec": {
                **spec,
                "selector": {"matchLabels": selector},
                # One replica at a time, never below the desired count: a GPU pod is slow to
                # start and expensive to lose.
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {
                    "metadata": {
                        "labels": {**config.extra_labels, **selector, ROLE_LABEL: "active"},
                        "annotations": {GENERATION_ANNOTATION: str(deployment.generation)}},
                    "spec": pod_spec(deployment, config),
                },
            },
        },
        {
            "apiVersion": "v1", "kind": "Service",
            "metadata": metadata(deployment, config, deployment.name),
            "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses":
                     False, "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                                       "protocol": "TCP"}]},
        },
        {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(deployment, config, deployment.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        },
        network_policy(deployment, config),
    ]
    if scaling == "hpa":
        objects.append(hpa(deployment, config))
    elif scaling == "keda":
        objects.append(scaled_object(deployment, config))
    return objects


def engine_key_secret_name(deployment: Deployment) -> str:
    return f"{deployment.name}-engine-key"


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
        "metadata": metadata(deployment, config, deployment.name),
        "spec": {"podSelector": {"matchLabels": owner_labels(deployment)},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": PORT}]}]},
    }


def hpa(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling on waiting requests per pod (needs a Prometheus adapter exposing
    `vllm:num_requests_waiting` as a pods metric)."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(deployment, config, deployment.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment.name},
            "minReplicas": max(1, deployment.min_replicas),
            "maxReplicas": max(1, deployment.max_replicas, deployment.min_replicas),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "vllm:num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2"}}}],
        },
    }


def scaled_object(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling through KEDA's Prometheus scaler on waiting requests."""
    query = (f'sum(vllm:num_requests_waiting{{namespace="{config.namespace}",'
             f'model_name="{deployment.served_model_name()}"}})')
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": metadata(deployment, config, deployment.name),
        "spec": {
            "scaleTargetRef": {"name": deployment.name},
            "minReplicaCount": deployment.min_replicas,
            "maxReplicaCount": max(1, deployment.max_replicas, deployment.min_replicas),
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": config.prometheus_address, "query": query,
                "threshold": "2"}}],
        },
    }


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as YAML for a person to read: a Secret's values are left out (the
    engine key is never shown after it is made; the control plane applies it itself)."""
    import yaml

    shown = [{**{k: v for k, v in obj.items() if k != "data"},
              "stringData": dict.fromkeys(obj.get("data") or {}, "(hidden: applied by the "
                                                                 "control plane)")}
             if obj["kind"] == "Secret" else obj for obj in objects]
    return "".join("---\n" + yaml.safe_dump(obj, sort_keys=False) for obj in shown)
