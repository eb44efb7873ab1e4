"""The Kubernetes backend's calls to the API server, through the official `kubernetes`
client: server-side apply under one field manager, the pods of a deployment, the
pod-deletion cost that picks which pods a scale-down removes, and removal of everything
made for a deployment (selected by owner labels, and checked again here before each
delete, so nothing else is ever touched).

Every failure becomes a ClusterError carrying the API server's status and message, for the
deployment's conditions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controlplane.backends.k8s_manifests import FIELD_MANAGER, KubernetesConfig

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REQUEST_TIMEOUT = 30.0


class ClusterError(Exception):
    """A call to the API server failed; `status` is its HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}" if self.status else self.message


def _error(exc: Exception, doing: str) -> ClusterError:
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        message = exc.reason or ""
        try:
            body = json.loads(exc.body or "{}")
            message = body.get("message") or message
        except (TypeError, ValueError):
            pass
        return ClusterError(int(exc.status or 0), f"{doing}: {message}")
    return ClusterError(0, f"{doing}: the API server cannot be reached ({exc})")


@dataclass
class Kind:
    """How to apply, list and delete one kind of object with the typed client."""

    api: str  # the client class
    patch: str
    read_list: str
    delete: str


KINDS: dict[tuple[str, str], Kind] = {
    ("apps/v1", "Deployment"): Kind("AppsV1Api", "patch_namespaced_deployment",
                                    "list_namespaced_deployment",
                                    "delete_namespaced_deployment"),
    ("v1", "Service"): Kind("CoreV1Api", "patch_namespaced_service",
                            "list_namespaced_service", "delete_namespaced_service"),
    ("policy/v1", "PodDisruptionBudget"): Kind(
        "PolicyV1Api", "patch_namespaced_pod_disruption_budget",
        "list_namespaced_pod_disruption_budget", "delete_namespaced_pod_disruption_budget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): Kind(
        "AutoscalingV2Api", "patch_namespaced_horizontal_pod_autoscaler",
        "list_namespaced_horizontal_pod_autoscaler",
        "delete_namespaced_horizontal_pod_autoscaler"),
}


def api_client(config: KubernetesConfig, api_url: str = "") -> Any:
    """An ApiClient for this backend: an explicit URL (a `kubectl proxy`, or the stand-in
    API server of the tests), the in-cluster service account, or a kubeconfig."""
    from kubernetes import client
    from kubernetes import config as loader

    if api_url:
        return client.ApiClient(client.Configuration(host=api_url.rstrip("/")))
    configuration = client.Configuration()
    try:
        if config.in_cluster:
            loader.load_incluster_config(client_configuration=configuration)
        else:
            loader.load_kube_config(config_file=config.kubeconfig or None,
                                    context=config.context or None,
                                    client_configuration=configuration)
    except Exception as exc:  # the loaders raise several kinds; all mean "no cluster"
        raise ClusterError(0, f"no Kubernetes configuration: {exc}") from None
    return client.ApiClient(configuration)


class Cluster:
    def __init__(self, config: KubernetesConfig, client: Any) -> None:
        self.config = config
        self.client = client

    def _call(self, kind: Kind, method: str, doing: str, *args: Any, **kwargs: Any) -> Any:
        from kubernetes import client as k8s

        api = getattr(k8s, kind.api)(self.client)
        function: Callable[..., Any] = getattr(api, method)
        try:
            return function(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except Exception as exc:
            raise _error(exc, doing) from None

    def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply: create or update, the fields this manager sets."""
        kind = KINDS.get((obj["apiVersion"], obj["kind"]))
        if kind is None:
            raise ClusterError(0, f"cannot apply a {obj['apiVersion']} {obj['kind']}")
        name = obj["metadata"]["name"]
        self._call(kind, kind.patch, f"applying {obj['kind']} {name}", name,
                   self.config.namespace, obj, field_manager=FIELD_MANAGER, force=True,
                   _content_type="application/apply-patch+yaml")

    def owned(self, labels: dict[str, str]) -> list[tuple[Kind, str]]:
        """Every object of the kinds this backend makes that carries all these labels."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        found = []
        for (_, kind_name), kind in KINDS.items():
            answer = self._call(kind, kind.read_list, f"listing {kind_name}s",
                                self.config.namespace, label_selector=selector)
            for item in answer.items or []:
                item_labels = item.metadata.labels or {}
                # Checked here too: nothing without every owner label is ever deleted.
                if all(item_labels.get(key) == value for key, value in labels.items()):
                    found.append((kind, item.metadata.name))
        return found

    def delete_owned(self, labels: dict[str, str]) -> int:
        """Remove everything made for a deployment; returns how many objects went."""
        removed = 0
        for kind, name in self.owned(labels):
            try:
                self._call(kind, kind.delete, f"deleting {kind.read_list[15:]} {name}", name,
                           self.config.namespace, propagation_policy="Foreground")
                removed += 1
            except ClusterError as exc:
                if exc.status != 404:  # gone already: what was wanted
                    raise
        return removed

    def pods(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The deployment's pods, as plain dicts (the API's own field names)."""
        from kubernetes import client as k8s

        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        core = Kind("CoreV1Api", "", "list_namespaced_pod", "")
        answer = self._call(core, core.read_list, "listing pods", self.config.namespace,
                            label_selector=selector)
        serialise = k8s.ApiClient().sanitize_for_serialization
        pods = [serialise(item) for item in answer.items or []]
        return [pod for pod in pods if all(
            (pod.get("metadata", {}).get("labels") or {}).get(key) == value
            for key, value in labels.items())]

    def set_deletion_cost(self, pod: str, cost: int) -> None:
        """Lower costs go first when the ReplicaSet scales down."""
        core = Kind("CoreV1Api", "patch_namespaced_pod", "", "")
        self._call(core, core.patch, f"marking pod {pod}", pod, self.config.namespace,
                   {"metadata": {"annotations": {DELETION_COST: str(cost)}}},
                   _content_type="application/merge-patch+json")
