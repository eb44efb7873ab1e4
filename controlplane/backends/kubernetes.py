"""The Kubernetes backend: each deployment is an apps/v1 Deployment of vLLM pods (plus a
headless Service, a PodDisruptionBudget and, with native scaling, an HPA or a KEDA
ScaledObject), applied by server-side apply; its pods are the replicas.

The backend keeps no per-replica processes. Once per reconcile pass `refresh` reads what
is applied (one list per kind) and the pods (from a watch kept open in a thread: list,
then watch from the list's resourceVersion, re-list on 410 Gone, reconnect with backoff).
`apply` writes only when the rendered objects differ from what the cluster holds, compared
through a hash annotation, so a resync with nothing changed sends no write request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import httpx

from controlplane.backends import vllm_http
from controlplane.backends.base import BackendConfigError, BackendError, Member
from controlplane.backends.k8s_client import Cluster, ClusterError, Watch, api_client
from controlplane.backends.k8s_manifests import (
    INSTANCE_LABEL,
    ROLE_LABEL,
    KubernetesConfig,
    check_allowed,
    deployment_key,
    managed_labels,
    owner_labels,
    render,
)
from controlplane.backends.k8s_pods import observe_pod

if TYPE_CHECKING:
    from collections.abc import Callable

    from controlplane.models import Deployment, Replica

logger = logging.getLogger(__name__)

HASH_ANNOTATION = "fleetplane.io/applied-hash"
# managed-by and this install (settings.INSTALL_ID): another install's objects in the
# namespace are never listed, adopted or deleted.
MANAGED = managed_labels()
# Victims of the next scale-down get this pod-deletion cost (the default is 0).
REMOVAL_COST = -1000
WATCH_SECONDS = 300
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0


def spec_hash(objects: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:20]


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class PodWatcher:
    """Keeps every pod this control plane manages in the namespace, in memory."""

    def __init__(self, cluster: Cluster, on_change: Callable[[], None]) -> None:
        self.cluster = cluster
        self.on_change = on_change
        self.lock = threading.Lock()
        self.pods: dict[str, dict[str, Any]] = {}
        self.synced = False  # a list succeeded and no error since
        self.watching = False  # a watch is open
        self.error: ClusterError | None = None
        self.lists = 0
        self.failures = 0
        self.delay = BACKOFF_FIRST
        self.stopping = threading.Event()
        self.open_watch: Watch | None = None
        self.thread = threading.Thread(target=self.run, daemon=True, name="pod-watch")

    def start(self) -> PodWatcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.open_watch is not None:
            self.open_watch.close()

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.pods.values())

    def run(self) -> None:
        self.delay = BACKOFF_FIRST
        while not self.stopping.is_set():
            try:
                version = self.relist()
                while not self.stopping.is_set():
                    version = self.follow(version)
            except Gone:
                logger.info("pod watch expired (410 Gone): listing again")
            except Exception as exc:
                if self.stopping.is_set():
                    break
                if isinstance(exc, ClusterError) and exc.status == 410:
                    logger.info("pod watch expired (HTTP 410): listing again")
                    continue
                error = exc if isinstance(exc, ClusterError) else ClusterError(
                    0, f"watching pods: the connection failed ({exc.__class__.__name__})")
                self.error, self.synced, self.watching = error, False, False
                self.failures += 1
                logger.warning("pod watch failed (%s); again in %.0f s", error, self.delay)
                self.stopping.wait(self.delay)
                self.delay = min(self.delay * 2, BACKOFF_MAX)

    def relist(self) -> str:
        self.watching = False
        pods, version = self.cluster.list_pods(MANAGED)
        with self.lock:
            self.pods = {pod["metadata"]["name"]: pod for pod in pods}
        self.lists += 1
        self.synced, self.error = True, None
        self.on_change()
        return version

    def follow(self, version: str) -> str:
        self.open_watch = self.cluster.watch_pods(MANAGED, version, WATCH_SECONDS)
        self.watching, self.delay = True, BACKOFF_FIRST
        for event in self.open_watch:
            if self.stopping.is_set():
                break
            kind, obj = event.get("type"), event["object"]
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone
                raise ClusterError(int(obj.get("code") or 0),
                                   f"watching pods: {obj.get('message') or obj}")
            metadata = obj.get("metadata") or {}
            name = str(metadata.get("name") or "")
            version = str(metadata.get("resourceVersion") or version)
            labels = metadata.get("labels") or {}
            if kind == "BOOKMARK" or any(labels.get(k) != v for k, v in MANAGED.items()):
                continue
            with self.lock:
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:
                    self.pods[name] = obj
            self.on_change()
        return version


def _request_reconcile() -> None:
    from controlplane.controllers import request_reconcile

    request_reconcile()


class KubernetesBackend:
    creates_replicas = True
    owns_pods = True

    def __init__(self, config: KubernetesConfig, *, api_url: str = "", watch: bool = True,
                 on_change: Callable[[], None] = _request_reconcile) -> None:
        self.config = config
        self.api_url = api_url
        self.watch = watch
        self.on_change = on_change
        self._cluster: Cluster | None = None
        self.watcher: PodWatcher | None = None
        # As of the last refresh, per deployment (deployment_key, the instance label):
        # applied objects -> their hash; pods.
        self.objects: dict[str, dict[tuple[str, str], str]] = {}
        self.pods: dict[str, list[dict[str, Any]]] = {}
        self.writes = 0  # write requests sent (the benchmark checks a resync sends none)
        self.http = httpx.Client(limits=httpx.Limits(max_connections=64))

    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = Cluster(self.config, api_client(self.config, self.api_url))
        return self._cluster

    def close(self) -> None:
        if self.watcher:
            self.watcher.stop()
        self.http.close()

    # --- reading ---------------------------------------------------------------------

    def refresh(self) -> None:
        cluster = self.cluster()
        objects: dict[str, dict[tuple[str, str], str]] = {}
        for kind, name, labels, notes in cluster.managed(MANAGED):
            objects.setdefault(labels.get(INSTANCE_LABEL, ""), {})[kind, name] = notes.get(
                HASH_ANNOTATION, "")
        if self.watch and self.watcher is None:
            self.watcher = PodWatcher(cluster, self.on_change).start()
        if self.watcher and self.watcher.synced:
            pods = self.watcher.snapshot()
        else:  # no watch (yet, or it is reconnecting): list them
            pods = cluster.list_pods(MANAGED)[0]
        by_id: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            by_id.setdefault(str(labels.get(INSTANCE_LABEL, "")), []).append(pod)
        self.objects, self.pods = objects, by_id

    def members(self, deployment: Deployment) -> list[Member]:
        return [observe_pod(pod) for pod in self.pods.get(deployment_key(deployment), [])]

    def scales_itself(self) -> bool:
        return self.config.scaling != "controlplane"

    # --- writing ---------------------------------------------------------------------

    def apply(self, deployment: Deployment) -> bool:
        try:  # stored before the allow-lists, or a setting narrowed since
            check_allowed(self.config.as_dict())
        except BackendConfigError as exc:
            raise BackendError(f"the backend's {exc.field}: {exc.message}") from None
        objects = render(deployment, self.config)
        digest = spec_hash(objects)
        applied = self.objects.get(deployment_key(deployment), {})
        wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
        if all(applied.get(key) == digest for key in wanted) and set(applied) <= wanted:
            return False
        cluster = self.cluster()
        for obj in objects:
            obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
            cluster.apply(obj)
            self.writes += 1
        for kind, name in set(applied) - wanted:  # e.g. an HPA after scaling changed
            cluster.delete(kind, name)
            self.writes += 1
        self.objects[deployment_key(deployment)] = dict.fromkeys(wanted, digest)
        return True

    def set_role(self, deployment: Deployment, replica: Replica, role: str) -> None:
        self.cluster().set_labels(replica.pod_name, {ROLE_LABEL: role})
        self.writes += 1
        for pod in self.pods.get(deployment_key(deployment), []):  # seen at once, before the watch
            if pod["metadata"]["name"] == replica.pod_name:
                pod["metadata"].setdefault("labels", {})[ROLE_LABEL] = role

    def mark_for_removal(self, replica: Replica) -> None:
        self.cluster().set_deletion_cost(replica.pod_name, REMOVAL_COST)
        self.writes += 1

    def remove(self, deployment: Deployment) -> bool:
        key = deployment_key(deployment)
        if self.objects.get(key):
            self.writes += self.cluster().delete_owned(owner_labels(deployment))
            self.objects.pop(key, None)
        return not self.pods.get(key)

    # --- one member ------------------------------------------------------------------

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        if self.config.warm_up:
            vllm_http.warm_up(self.http, deployment, replica.endpoint)

    def in_flight(self, replica: Replica) -> int | None:
        if not replica.endpoint:
            return None
        return vllm_http.in_flight(self.http, replica.endpoint,
                                   replica.deployment.engine_key())

    def logs(self, replica: Replica, lines: int) -> list[str]:
        if not replica.pod_name:
            return []
        try:
            return self.cluster().pod_log(replica.pod_name, lines)
        except BackendError as exc:
            return [f"(no log: {exc})"]
