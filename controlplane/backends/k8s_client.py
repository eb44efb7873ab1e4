"""The Kubernetes backend's calls to the API server, through the official `kubernetes`
client: the server's version, server-side apply under one field manager (and the
handover manager of an autoscaler switch), the live objects made for deployments (whole,
so drift can be found), the pods of a deployment, their ReplicaSets and the namespace's
events (why pods are missing or failing), the pod-deletion cost that picks which pods a
scale-down removes, and removal of everything made for a deployment (selected by owner
labels, and checked again here before each delete, so nothing else is ever touched).

Every failure becomes a ClusterError carrying the API server's status and message, for the
deployment's conditions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from controlplane.backends.base import BackendError
from controlplane.backends.k8s_manifests import FIELD_MANAGER, KubernetesConfig
from controlplane.backends.k8s_pods import DELETION_COST

REQUEST_TIMEOUT = 30.0
# The pods' preStop hook uses the `sleep` action, which Kubernetes serves from 1.30 on.


class ClusterError(BackendError):
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
    cause = str(getattr(exc, "reason", None) or exc)  # urllib3 wraps the socket's error
    return ClusterError(0, f"{doing}: the API server cannot be reached ({cause[:300]})")


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
    ("networking.k8s.io/v1", "NetworkPolicy"): Kind(
        "NetworkingV1Api", "patch_namespaced_network_policy",
        "list_namespaced_network_policy", "delete_namespaced_network_policy"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): Kind(
        "AutoscalingV2Api", "patch_namespaced_horizontal_pod_autoscaler",
        "list_namespaced_horizontal_pod_autoscaler",
        "delete_namespaced_horizontal_pod_autoscaler"),
    # Last: removal deletes in this order, and a pod restarting meanwhile still finds it.
    ("v1", "Secret"): Kind("CoreV1Api", "patch_namespaced_secret", "list_namespaced_secret",
                           "delete_namespaced_secret"),
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
        self.absent: set[str] = set()  # custom kinds whose API answered 403 or 404

    def _call(self, kind: Kind, method: str, doing: str, *args: Any, **kwargs: Any) -> Any:
        from kubernetes import client as k8s

        api = getattr(k8s, kind.api)(self.client)
        function: Callable[..., Any] = getattr(api, method)
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            raise _error(exc, doing) from None

    def server_version(self) -> dict[str, Any]:
        """The API server's /version answer (major, minor, gitVersion ...)."""
        from kubernetes import client as k8s

        try:
            response: Any = k8s.VersionApi(self.client).get_code(
                _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            answer = json.loads(response.data or b"{}")
        except Exception as exc:
            raise _error(exc, "reading the API server's version") from None
        return answer if isinstance(answer, dict) else {}

    def apply(self, obj: dict[str, Any], *, manager: str = FIELD_MANAGER,
              force: bool = True) -> None:
        """Server-side apply: create or update the fields this manager sets. `force`
        takes fields another manager set to another value (the backend's own fields
        only: it applies nothing else); without it such a field is a 409 Conflict."""
        name = obj["metadata"]["name"]
        custom = CUSTOM.get(obj["kind"])
        if custom is not None and custom.api_version == obj["apiVersion"]:
            self._custom(obj["kind"], "patch_namespaced_custom_object",
                         f"applying {obj['kind']} {name}", name, obj, field_manager=manager,
                         force=force, _content_type="application/apply-patch+yaml")
            return
        kind = KINDS.get((obj["apiVersion"], obj["kind"]))
        if kind is None:
            raise ClusterError(0, f"cannot apply a {obj['apiVersion']} {obj['kind']}")
        self._call(kind, kind.patch, f"applying {obj['kind']} {name}", name,
                   self.config.namespace, obj, field_manager=manager, force=force,
                   _content_type="application/apply-patch+yaml")

    def _listed(self, kind: Kind, kind_name: str, labels: dict[str, str]
                ) -> list[dict[str, Any]]:
        """Every object of one kind that carries all these labels, whole, as plain dicts
        with the API's own field names (checked here too: nothing without every owner
        label may ever be touched)."""
        if kind_name in CUSTOM:
            answer = self._custom(kind_name, "list_namespaced_custom_object",
                                  f"listing {kind_name}s", label_selector=selector(labels))
            items = list(answer.get("items") or [])
        else:
            items = self._raw_list(kind, kind.read_list, f"listing {kind_name}s",
                                   label_selector=selector(labels))
        return [item for item in items if all(
            ((item.get("metadata") or {}).get("labels") or {}).get(key) == value
            for key, value in labels.items())
            # Made by another controller from one of ours (KEDA's HPA copies its
            # ScaledObject's labels): never this backend's to keep or remove.
            and not (item.get("metadata") or {}).get("ownerReferences")]

    def _raw_list(self, kind: Kind, method: str, doing: str, **kwargs: Any
                  ) -> list[dict[str, Any]]:
        """A list's items as the server sent them (faster than the typed models, and
        nothing the models do not know is lost)."""
        response = self._call(kind, method, doing, self.config.namespace,
                              _preload_content=False, **kwargs)
        try:
            answer = json.loads(response.data or b"{}")
        except ValueError:
            raise ClusterError(0, f"{doing}: the API server's answer is not JSON") from None
        return [item for item in answer.get("items") or [] if isinstance(item, dict)]

    def uses(self, kind_name: str) -> bool:
        """Whether the configuration makes objects of this custom kind."""
        if kind_name == "ScaledObject":
            return self.config.scaling == "keda"
        return kind_name == "PodMonitor" and self.config.pod_monitor

    def kinds(self) -> list[tuple[str, Kind]]:
        """The kinds this backend makes. A custom kind (KEDA's ScaledObject, the Prometheus
        Operator's PodMonitor) where the configuration uses it, and also elsewhere until
        its API answers 403 or 404 (it exists only where that operator is installed, and
        its Role is applied): a backend whose configuration changed still finds, and
        removes, the objects it made."""
        kinds = [(name, kind) for (_, name), kind in KINDS.items()]
        kinds += [(name, CUSTOM_KIND) for name in CUSTOM
                  if self.uses(name) or name not in self.absent]
        return kinds

    def live(self, labels: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
        """(kind, object) of every object carrying these labels, as the server holds it."""
        found: list[tuple[str, dict[str, Any]]] = []
        for kind_name, kind in self.kinds():
            try:
                items = self._listed(kind, kind_name, labels)
            except ClusterError as exc:
                if kind is CUSTOM_KIND and not self.uses(kind_name) and exc.status in (
                        403, 404):
                    self.absent.add(kind_name)
                    continue
                raise
            found += [(kind_name, item) for item in items]
        return found

    def managed(self, labels: dict[str, str]) -> list[tuple[str, str, dict[str, str],
                                                             dict[str, str]]]:
        """(kind, name, labels, annotations) of every object carrying these labels."""
        return [(kind_name, str(metadata.get("name")), dict(metadata.get("labels") or {}),
                 dict(metadata.get("annotations") or {}))
                for kind_name, item in self.live(labels)
                for metadata in [item.get("metadata") or {}]]

    def replica_sets(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The ReplicaSets whose pods carry these labels (their labels are the pod
        template's), as plain dicts."""
        items = self._raw_list(APPS, "list_namespaced_replica_set", "listing ReplicaSets",
                               label_selector=selector(labels))
        return [item for item in items if all(
            ((item.get("metadata") or {}).get("labels") or {}).get(key) == value
            for key, value in labels.items())]

    def events(self) -> list[dict[str, Any]]:
        """The namespace's warning events (core/v1), as plain dicts."""
        return self._raw_list(CORE, "list_namespaced_event", "listing events",
                              field_selector="type=Warning")

    def delete(self, kind_name: str, name: str, propagation: str = "Foreground") -> None:
        """Remove one object this backend made (gone already is fine). `Orphan` leaves
        what it owns (a Deployment's ReplicaSets and pods) in place."""
        kind = dict(self.kinds()).get(kind_name)
        if kind is None:
            return
        try:
            if kind is CUSTOM_KIND:
                self._custom(kind_name, "delete_namespaced_custom_object",
                             f"deleting {kind_name} {name}", name)
            else:
                self._call(kind, kind.delete, f"deleting {kind_name} {name}", name,
                           self.config.namespace, propagation_policy=propagation)
        except ClusterError as exc:
            if exc.status != 404:
                raise

    def delete_owned(self, labels: dict[str, str]) -> int:
        """Remove everything made for a deployment; returns how many objects went."""
        removed = 0
        for kind_name, name, _, _ in self.managed(labels):
            self.delete(kind_name, name)
            removed += 1
        return removed

    def _custom(self, kind_name: str, method: str, doing: str, *args: Any,
                **kwargs: Any) -> Any:
        custom = CUSTOM[kind_name]
        return self._call(CUSTOM_KIND, method, doing, custom.group, custom.version,
                          self.config.namespace, custom.plural, *args, **kwargs)

    def list_pods(self, labels: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
        """Pods carrying these labels, as plain dicts (the API's own field names), and the
        list's resourceVersion to watch from."""
        from kubernetes import client as k8s

        answer = self._call(CORE, "list_namespaced_pod", "listing pods",
                            self.config.namespace, label_selector=selector(labels))
        serialise = k8s.ApiClient().sanitize_for_serialization
        pods = [serialise(item) for item in answer.items or []]
        version = str((answer.metadata and answer.metadata.resource_version) or "")
        return [pod for pod in pods if all(
            (pod.get("metadata", {}).get("labels") or {}).get(key) == value
            for key, value in labels.items())], version

    def watch_pods(self, labels: dict[str, str], resource_version: str,
                   timeout_seconds: int) -> Watch:
        """Open a watch of pods from resource_version on; returns once the server has
        answered. Its events (type and object as plain dicts) end when the server ends
        the watch; ERROR events are passed on (410: re-list)."""
        response = self._call(CORE, "list_namespaced_pod", "watching pods",
                              self.config.namespace, label_selector=selector(labels),
                              watch=True, resource_version=resource_version or None,
                              allow_watch_bookmarks=True, timeout_seconds=timeout_seconds,
                              _preload_content=False,
                              _request_timeout=(REQUEST_TIMEOUT, timeout_seconds + 30))
        return Watch(response)

    def set_deletion_cost(self, pod: str, cost: int) -> None:
        """Lower costs go first when the ReplicaSet scales down."""
        self._patch_pod(pod, {"metadata": {"annotations": {DELETION_COST: str(cost)}}},
                        f"marking pod {pod}")

    def set_labels(self, pod: str, labels: dict[str, str]) -> None:
        self._patch_pod(pod, {"metadata": {"labels": labels}}, f"labelling pod {pod}")

    def _patch_pod(self, pod: str, body: dict[str, Any], doing: str) -> None:
        self._call(CORE, "patch_namespaced_pod", doing, pod, self.config.namespace, body,
                   _content_type="application/merge-patch+json")

    def pod_log(self, pod: str, lines: int) -> list[str]:
        text = self._call(CORE, "read_namespaced_pod_log", f"reading the log of {pod}", pod,
                          self.config.namespace, container="vllm", tail_lines=lines)
        return str(text or "").splitlines()[-lines:]


class Watch:
    """An open watch: iterate for its events; close() ends it from any thread."""

    def __init__(self, response: Any) -> None:
        self.response = response

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from kubernetes.watch.watch import iter_resp_lines

        try:
            for line in iter_resp_lines(self.response):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("object"), dict):
                    yield event
        finally:
            self.response.release_conn()

    def close(self) -> None:
        self.response.shutdown()  # wakes a read blocked in another thread


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


CORE = Kind("CoreV1Api", "", "", "")
APPS = Kind("AppsV1Api", "", "", "")
CUSTOM_KIND = Kind("CustomObjectsApi", "patch_namespaced_custom_object",
                   "list_namespaced_custom_object", "delete_namespaced_custom_object")


@dataclass(frozen=True)
class Custom:
    """A kind an operator adds (its API exists only where the operator is installed)."""

    group: str
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


CUSTOM = {"ScaledObject": Custom("keda.sh", "v1alpha1", "scaledobjects"),
          "PodMonitor": Custom("monitoring.coreos.com", "v1", "podmonitors")}
