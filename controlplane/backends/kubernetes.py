"""The Kubernetes backend: each deployment is an apps/v1 Deployment of vLLM pods (plus a
headless Service, a PodDisruptionBudget and, with native scaling, an HPA or a KEDA
ScaledObject), applied by server-side apply; its pods are the replicas.

The backend keeps no per-replica processes. Once per client it checks the API server's
version (1.30 or later). Once per reconcile pass `refresh` reads what is applied (one list
per kind, the objects whole) and the pods (from a watch kept open in a thread: list, then
watch from the list's resourceVersion, re-list on 410 Gone, reconnect with backoff), and,
while a deployment is not fully ready, why (ReplicaSets and warning events). `apply`
writes only the objects whose rendering changed (a hash annotation) or whose live fields
differ from the rendered ones (drift: put back, and told with the manager that changed
them), so a resync with nothing changed sends no write request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from controlplane.backends import k8s_drift, k8s_failures, vllm_http
from controlplane.backends.base import BackendConfigError, BackendError, Member
from controlplane.backends.k8s_client import Cluster, ClusterError, api_client
from controlplane.backends.k8s_config import KubernetesConfig, check_allowed
from controlplane.backends.k8s_manifests import render
from controlplane.backends.k8s_names import (
    FIELD_MANAGER,
    INSTALL_LABEL,
    INSTANCE_LABEL,
    ROLE_LABEL,
    deployment_key,
    owner_labels,
    selector_changed,
)
from controlplane.backends.k8s_pods import DELETION_COST, observe_pod
from controlplane.backends.k8s_version import UnsupportedKubernetesVersion, check_server_version
from controlplane.backends.k8s_watch import MANAGED, PodWatcher
from controlplane.wakeups import request_reconcile

if TYPE_CHECKING:
    from collections.abc import Callable

    from controlplane.models import Deployment, Replica

logger = logging.getLogger(__name__)

HASH_ANNOTATION = "fleetplane.io/applied-hash"
# Victims of the next scale-down get this pod-deletion cost (the default is 0).
REMOVAL_COST = -1000
# The manager that holds `spec.replicas` while an autoscaler takes it over.
HANDOVER_MANAGER = "fleetplane-handover"
OUR_MANAGERS = (FIELD_MANAGER, HANDOVER_MANAGER)
AUTOSCALERS = ("HorizontalPodAutoscaler", "ScaledObject")
# ReplicaSets and events are read at most this often, and only while a deployment is
# not fully ready.
TROUBLE_READ_SECONDS = 10.0
VERSION_RECHECK_SECONDS = 60.0


def spec_hash(objects: list[dict[str, Any]]) -> str:
    """A short hash of rendered objects: what the hash annotation holds."""
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:20]


class KubernetesBackend:
    """The Kubernetes `PodSetBackend`: an apps/v1 Deployment of vLLM pods per deployment."""

    creates_replicas = True
    owns_pods = True

    def __init__(self, config: KubernetesConfig, *, api_url: str = "", watch: bool = True,
                 on_change: Callable[[], None] = request_reconcile) -> None:
        self.config = config
        self.api_url = api_url
        self.watch = watch
        self.on_change = on_change
        self._cluster: Cluster | None = None
        self.watcher: PodWatcher | None = None
        self.version_ok = False  # the API server's version was checked, once per client
        self.version_refused: tuple[float, UnsupportedKubernetesVersion] | None = None
        # As of the last refresh, per deployment id: the live objects; the pods; troubles.
        self.live: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
        self.pods: dict[str, list[dict[str, Any]]] = {}
        self.troubles: dict[str, list[str]] = {}
        self.troubles_read_at = float("-inf")
        self.replica_sets: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        # What the last apply did that a person should hear about (drift put back, a
        # handover to an autoscaler), per deployment id, until the reconciler takes it.
        self.notes: dict[str, list[tuple[str, str]]] = {}
        self.writes = 0  # write requests sent (the benchmark checks a resync sends none)
        # Every backend shares one pooled client (one TLS context for the process).
        self.http = vllm_http.shared_client()

    def cluster(self) -> Cluster:
        """The API client, made at first use."""
        if self._cluster is None:
            self._cluster = Cluster(self.config, api_client(self.config, self.api_url))
        return self._cluster

    def close(self) -> None:
        """Stop the pod watch (the HTTP client is shared: it stays open)."""
        if self.watcher:
            self.watcher.stop()

    # --- reading ---------------------------------------------------------------------

    def check_version(self, cluster: Cluster) -> None:
        """Once per client: refuse an API server older than Kubernetes 1.30 (a refusal
        is asked again after a minute, so an upgraded server is taken)."""
        if self.version_ok:
            return
        now = time.monotonic()
        if self.version_refused and now - self.version_refused[0] < VERSION_RECHECK_SECONDS:
            raise self.version_refused[1]
        try:
            check_server_version(cluster.server_version())
        except UnsupportedKubernetesVersion as exc:
            self.version_refused = (now, exc)
            raise
        self.version_ok, self.version_refused = True, None

    def refresh(self) -> None:
        """Read what is applied, the pods and why pods are missing, once per pass."""
        cluster = self.cluster()
        self.check_version(cluster)
        live: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
        for kind, obj in cluster.live(MANAGED):
            metadata = obj.get("metadata") or {}
            live.setdefault(str((metadata.get("labels") or {}).get(INSTANCE_LABEL, "")), {})[
                kind, str(metadata.get("name") or "")] = obj
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
        self.live, self.pods = live, by_id
        self.read_troubles(cluster)

    def read_troubles(self, cluster: Cluster) -> None:
        """Why pods are missing or failing, for the deployments not fully ready only, and
        read (ReplicaSets, the namespace's warning events: one list each) at most every
        TROUBLE_READ_SECONDS; a failure to read them is logged, never fatal."""
        waiting: dict[str, set[str]] = {}
        for key in set(self.live) | set(self.pods):
            deployment = self.deployment_object(key)
            status = (deployment or {}).get("status") or {}
            members = [observe_pod(p) for p in self.pods.get(key, [])]
            not_ready = {m.name for m in members if m.phase != "ready" and not m.deleting}
            count = ((deployment or {}).get("spec") or {}).get("replicas")
            ready = sum(1 for m in members if m.phase == "ready" and not m.deleting)
            if not_ready or (count is not None and ready < int(count)) or any(
                    c.get("type") == "ReplicaFailure" and c.get("status") == "True"
                    for c in status.get("conditions") or []):
                waiting[key] = not_ready
        if waiting and time.monotonic() - self.troubles_read_at >= TROUBLE_READ_SECONDS:
            self.troubles_read_at = time.monotonic()
            self.replica_sets = self.read_quietly(lambda: cluster.replica_sets(MANAGED))
            self.events = self.read_quietly(cluster.events)
        troubles: dict[str, list[str]] = {}
        for key, names in waiting.items():
            sets = [r for r in self.replica_sets if str(((r.get("metadata") or {}).get(
                "labels") or {}).get(INSTANCE_LABEL, "")) == key]
            troubles[key] = k8s_failures.troubles(self.deployment_object(key), sets,
                                                  self.events, names)
        self.troubles = troubles

    @staticmethod
    def read_quietly(read: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """A list read for detail only: empty when the API server refuses it."""
        try:
            return read()
        except ClusterError as exc:  # e.g. a Role without the grant: only less detail
            logger.warning("reading why pods are missing failed: %s", exc)
            return []

    def deployment_object(self, key: str) -> dict[str, Any] | None:
        """The live apps/v1 Deployment of a deployment key, if any."""
        return next((obj for (kind, _), obj in self.live.get(key, {}).items()
                     if kind == "Deployment"), None)

    def members(self, deployment: Deployment) -> list[Member]:
        """The deployment's pods as members."""
        return [observe_pod(pod) for pod in self.pods.get(deployment_key(deployment), [])]

    def problems(self, deployment: Deployment) -> list[str]:
        """Why the deployment's pods are missing or failing, as of the last refresh."""
        return list(self.troubles.get(deployment_key(deployment), []))

    def notices(self, deployment: Deployment) -> list[tuple[str, str]]:
        """What the last apply did that a person should hear about (taken once)."""
        return self.notes.pop(deployment_key(deployment), [])

    def scales_itself(self) -> bool:
        """Whether an HPA or KEDA, not the control plane, sets the count."""
        return self.config.scaling != "controlplane"

    # --- writing ---------------------------------------------------------------------

    def apply(self, deployment: Deployment, replicas: int | None = None) -> bool:
        """Apply what differs from the live objects: an object is sent when its rendering
        changed (its hash annotation) or when a field it renders was changed by someone
        else (drift, put back and told). An autoscaler no longer wanted is removed
        before any count is applied, and a switch to one hands `spec.replicas` over at
        its live value, so the count never falls back to the default of 1."""
        try:  # stored before the allow-lists, or a setting narrowed since
            check_allowed(self.config.as_dict())
        except BackendConfigError as exc:
            raise BackendError(f"the backend's {exc.field}: {exc.message}") from None
        key = deployment_key(deployment)
        try:  # e.g. more GPUs than a node has, a model pods cannot download
            objects = render(deployment, self.config, replicas=replicas)
        except BackendConfigError as exc:
            raise BackendError(f"the deployment's {exc.field}: {exc.message}") from None
        live = self.live.get(key, {})
        wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
        stale = [item for item in live if item not in wanted]
        changed, notes = self.changes(objects, live)
        if not changed and not stale:
            return False
        cluster = self.cluster()
        for kind, name in stale:  # autoscalers first: none may fight the count applied
            if kind in AUTOSCALERS:
                cluster.delete(kind, name)
                self.writes += 1
                notes.append(("autoscaler-removed", f"{kind} {name} removed: the control "
                              f"plane sets the replica count again"))
        handover = self.handover(deployment, objects, live)
        if handover is not None:
            count, raised = handover["spec"]["replicas"], handover.pop("raised")
            # Raised to the floor, the value changes: the field's owner (the backend's own
            # stop to 0, or a `kubectl scale`) is overridden, and told so.
            cluster.apply(handover, manager=HANDOVER_MANAGER, force=bool(raised))
            self.writes += 1
            notes.append(("handover", "spec.replicas handed over to the autoscaler at "
                          + (f"its minimum, {count} (it was {raised - 1})" if raised else
                             f"its live value, {count}")))
        for obj in changed:
            try:
                cluster.apply(obj)
            except ClusterError as exc:
                told = self.recreate(cluster, deployment, obj, exc)
                if told is None:
                    raise
                if told:
                    notes.append(("recreated", told))
            self.writes += 1
        for kind, name in stale:
            if kind not in AUTOSCALERS:
                cluster.delete(kind, name)
                self.writes += 1
        self.notes.setdefault(key, []).extend(notes)
        return True

    @staticmethod
    def changes(objects: list[dict[str, Any]], live: dict[tuple[str, str], dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """The rendered objects to send (each given its hash annotation), and a note per
        object whose live fields someone else changed (drift)."""
        changed: list[dict[str, Any]] = []
        notes: list[tuple[str, str]] = []
        for obj in objects:
            digest = spec_hash([obj])
            held = live.get((obj["kind"], obj["metadata"]["name"]))
            found = k8s_drift.differences(obj, held) if held is not None else []
            ours_changed = held is None or ((held.get("metadata") or {}).get(
                "annotations") or {}).get(HASH_ANNOTATION) != digest
            if held is not None and found:
                drifted = [d for d in found if not ours_changed or any(
                    manager not in OUR_MANAGERS for manager in k8s_drift.owners(held, d))]
                if drifted:
                    text, _ = k8s_drift.describe(
                        obj["kind"], obj["metadata"]["name"], drifted, held,
                        ours=OUR_MANAGERS, main=obj["kind"] == "Deployment")
                    notes.append(("drift", text))
            if ours_changed or found:
                obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
                changed.append(obj)
        return changed, notes

    def recreate(self, cluster: Cluster, deployment: Deployment, obj: dict[str, Any],
                 error: ClusterError) -> str | None:
        """A Deployment refused because its selector is immutable: if it is this
        deployment's, applied by an older version of this install (the same name and
        instance, no other install's label), delete it and create it again. Returns what
        to tell (empty: nothing new), or None when the error stands. On a real cluster the
        old Deployment stays until its pods are gone (foreground deletion): until then
        each pass tries the create again, quietly."""
        if obj["kind"] != "Deployment" or error.status not in (409, 422):
            return None
        name = obj["metadata"]["name"]
        earlier = {"app.kubernetes.io/managed-by": MANAGED["app.kubernetes.io/managed-by"],
                   INSTANCE_LABEL: deployment_key(deployment)}
        ours = [held for kind, held in cluster.live(earlier) if kind == "Deployment"
                and (held.get("metadata") or {}).get("name") == name
                and ((held.get("metadata") or {}).get("labels") or {}).get(
                    INSTALL_LABEL, MANAGED[INSTALL_LABEL]) == MANAGED[INSTALL_LABEL]
                and selector_changed(held, obj)]
        if not ours:
            return None
        deleting = bool((ours[0].get("metadata") or {}).get("deletionTimestamp"))
        if not deleting:
            cluster.delete("Deployment", name)
            self.writes += 1
        try:
            cluster.apply(obj)
        except ClusterError:
            return "" if deleting else (
                f"Deployment {name} was applied by an older version with another selector, "
                f"which Kubernetes does not change: deleted (its pods stop first), created "
                f"again once it is gone")
        return f"Deployment {name} created again with this version's selector" if deleting \
            else (f"Deployment {name} was applied by an older version with another "
                  f"selector, which Kubernetes does not change: deleted and created again")

    def handover(self, deployment: Deployment, objects: list[dict[str, Any]],
                 live: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any] | None:
        """Kubernetes' documented way to hand `spec.replicas` to an autoscaler: before
        the backend's manager applies the Deployment without the field, a separate
        manager applies only the field, at its live value; the field stays (owned by that
        manager) and the autoscaler takes it from there. None when there is nothing to
        hand over (no live Deployment, an autoscaler already in place, the count ours).
        The count handed over is at least the autoscaler's minimum."""
        rendered = next((o for o in objects if o["kind"] == "Deployment"), None)
        held = live.get(("Deployment", rendered["metadata"]["name"])) if rendered else None
        if rendered is None or held is None or "replicas" in rendered["spec"]:
            return None
        if any(kind in AUTOSCALERS for kind, _ in live):
            return None
        count = (held.get("spec") or {}).get("replicas")
        if count is None:
            return None
        # Never below the autoscaler's floor: an HPA leaves a Deployment at 0 alone
        # (scaling disabled), so one started again after a stop would stay at 0.
        floor = max((int((o.get("spec") or {}).get(key) or 0) for o in objects
                     for key in ("minReplicas", "minReplicaCount")
                     if o["kind"] in AUTOSCALERS), default=0)
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": rendered["metadata"]["name"],
                             "namespace": self.config.namespace},
                "spec": {"replicas": max(int(count), floor)},
                # 1 + the live count when it is raised to the floor, else 0 (popped)
                "raised": int(count) + 1 if int(count) < floor else 0}

    def set_role(self, deployment: Deployment, replica: Replica, role: str) -> None:
        """Label a pod active or standby (seen at once, before the watch)."""
        self.cluster().set_labels(replica.pod_name, {ROLE_LABEL: role})
        self.writes += 1
        for pod in self.pods.get(deployment_key(deployment), []):  # seen at once, before the watch
            if pod["metadata"]["name"] == replica.pod_name:
                pod["metadata"].setdefault("labels", {})[ROLE_LABEL] = role

    def mark_for_removal(self, replica: Replica, marked: bool = True) -> None:
        """Make a pod the next one a scale-down removes (or no longer)."""
        cost = REMOVAL_COST if marked else 0
        self.cluster().set_deletion_cost(replica.pod_name, cost)
        self.writes += 1
        for pods in self.pods.values():  # seen at once, before the watch
            for pod in pods:
                if pod["metadata"]["name"] == replica.pod_name:
                    pod["metadata"].setdefault("annotations", {})[DELETION_COST] = str(cost)

    def remove(self, deployment: Deployment) -> bool:
        """Delete the deployment's objects; True once its pods are gone."""
        key = deployment_key(deployment)
        if self.live.get(key):
            self.writes += self.cluster().delete_owned(owner_labels(deployment))
            self.live.pop(key, None)
        return not self.pods.get(key)

    # --- one member ------------------------------------------------------------------

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        """Send the pod one real request before it takes traffic."""
        if self.config.warm_up:
            vllm_http.warm_up(self.http, deployment, replica.endpoint)

    def in_flight(self, replica: Replica) -> int | None:
        """Requests the pod is serving, from its /metrics."""
        if not replica.endpoint:
            return None
        return vllm_http.in_flight(self.http, replica.endpoint,
                                   replica.deployment.engine_key())

    def logs(self, replica: Replica, lines: int) -> list[str]:
        """The pod's last log lines."""
        if not replica.pod_name:
            return []
        try:
            return self.cluster().pod_log(replica.pod_name, lines)
        except BackendError as exc:
            return [f"(no log: {exc})"]
