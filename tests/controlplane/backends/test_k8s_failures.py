"""Failures are visible: why a deployment's pods are missing or failing reaches its
Degraded condition and its events in the API server's own words, each distinct message
once. Against the STAND-IN API server (kmock): the tests create the ReplicaSets and
events through the official client, as the cluster's controllers and kubelets would."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from controlplane.backends import kubernetes
from controlplane.backends.k8s_failures import troubles
from controlplane.models import AuditEvent, Deployment
from controlplane.reconciler import Reconciler
from tests.controlplane.k8s_support import converge, deployment_factory
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster

QUOTA = ('pods "chat-7d9c5-" is forbidden: exceeded quota: gpu-quota, requested: '
         'requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: '
         'requests.nvidia.com/gpu=4')
POD_SECURITY = ('pods "chat-7d9c5-" is forbidden: violates PodSecurity "restricted:latest": '
                'runAsNonRoot != true (pod or container "vllm" must set '
                'securityContext.runAsNonRoot=true)')


@pytest.fixture
def player(emulated: EmulatedCluster) -> ClusterPlayer:
    return ClusterPlayer(emulated.url)


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any, settings: Any,
         monkeypatch: pytest.MonkeyPatch) -> Callable[..., Deployment]:
    monkeypatch.setattr(kubernetes, "TROUBLE_READ_SECONDS", 0.0)
    return deployment_factory(emulated, tmp_path, settings)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def replica_set(player: ClusterPlayer, deployment: Deployment, wanted: int,
                failure: str = "") -> str:
    """The ReplicaSet the Deployment controller makes, its labels the pod template's."""
    name = "chat-7d9c5"
    stored = player.api.sanitize_for_serialization(
        player.apps.read_namespaced_deployment("chat", "inference"))
    labels = dict(stored["spec"]["template"]["metadata"]["labels"])
    conditions = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                   "message": failure, "lastTransitionTime": now()}] if failure else []
    player.apps.create_namespaced_replica_set("inference", {  # type: ignore[arg-type]
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": name, "namespace": "inference", "labels": labels},
        "spec": {"replicas": wanted, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [{"name": "vllm", "image": "x"}]}}},
        "status": {"replicas": 0, "readyReplicas": 0, "conditions": conditions}})
    return name


def warning(player: ClusterPlayer, kind: str, name: str, reason: str, message: str,
            serial: int = 1) -> None:
    player.core.create_namespaced_event("inference", {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason,
        "message": message, "count": 1, "lastTimestamp": now(), "firstTimestamp": now(),
        "metadata": {"name": f"{name}.{serial}", "namespace": "inference"},
        "involvedObject": {"kind": kind, "name": name, "namespace": "inference"},
        "source": {"component": "replicaset-controller"}})


def degraded(deployment: Deployment) -> str:
    deployment.refresh_from_db()
    condition = deployment.condition("Degraded") or {}
    return str(condition.get("message")) if condition.get("status") == "True" else ""


@pytest.mark.django_db
@pytest.mark.parametrize("message", [QUOTA, POD_SECURITY])
def test_failed_creates_show_on_the_deployment_with_the_servers_words(
        make: Callable[..., Deployment], player: ClusterPlayer, message: str) -> None:
    deployment = make(replicas=2)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    name = replica_set(player, deployment, 2, failure=message)
    for serial in range(3):  # the controller retries; each try is the same warning
        warning(player, "ReplicaSet", name, "FailedCreate", f"Error creating: {message}",
                serial)
    text = converge(reconciler, lambda: degraded(deployment), "a Degraded condition")
    assert f"ReplicaSet {name}: FailedCreate: {message}" in text
    assert text.count(message) == 1  # the condition and the events say it once
    for _ in range(3):
        reconciler.reconcile_all()
    [told] = AuditEvent.objects.filter(action="platform-warning")
    assert message in told.message


@pytest.mark.django_db
@pytest.mark.parametrize(("reason", "message"), [
    ("FailedScheduling", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. "
                         "preemption: 0/4 nodes are available."),
    ("FailedAttachVolume", 'AttachVolume.Attach failed for volume "pvc-1f2e" : rpc error: '
                           'code = Internal desc = volume is attached to another node'),
    ("FailedMount", 'MountVolume.SetUp failed for volume "models" : persistentvolumeclaim '
                    '"models" not found'),
    ("Failed", 'Failed to pull image "vllm/vllm-openai:nope": not found'),
    ("OOMKilling", "Memory cgroup out of memory: Killed process 4242 (python3)"),
])
def test_pod_warnings_show_on_the_deployment_coalesced(
        make: Callable[..., Deployment], player: ClusterPlayer, reason: str,
        message: str) -> None:
    deployment = make(replicas=2)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    assert player.sync() == ["chat-1", "chat-2"]  # created, never ready
    for pod in ("chat-1", "chat-2"):
        warning(player, "Pod", pod, reason, message)
    text = converge(reconciler, lambda: degraded(deployment), "a Degraded condition")
    assert f"Pod chat-1, chat-2: {reason}: {message}" in text
    for _ in range(3):
        reconciler.reconcile_all()
    assert AuditEvent.objects.filter(action="platform-warning").count() == 1
    # Once the pods serve, the old warnings are history: the condition clears.
    player.ready("chat-1", ip="10.1.0.1")
    player.ready("chat-2", ip="10.1.0.2")
    converge(reconciler, lambda: not degraded(deployment), "the condition cleared")


@pytest.mark.django_db
def test_a_deployment_past_its_progress_deadline_says_so(
        make: Callable[..., Deployment], player: ClusterPlayer) -> None:
    deployment = make(replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.apps.patch_namespaced_deployment_status("chat", "inference", {"status": {
        "conditions": [{"type": "Progressing", "status": "False",
                        "reason": "ProgressDeadlineExceeded",
                        "message": 'ReplicaSet "chat-7d9c5" has timed out progressing.'}]}},
        _content_type="application/merge-patch+json")
    text = converge(reconciler, lambda: degraded(deployment), "a Degraded condition")
    assert ('Deployment chat: ProgressDeadlineExceeded: ReplicaSet "chat-7d9c5" has timed '
            'out progressing.') in text


def test_old_events_and_events_of_serving_pods_are_left_out() -> None:
    fresh = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

    def event(name: str, at: datetime) -> dict[str, Any]:
        return {"type": "Warning", "reason": "FailedMount", "message": f"no volume {name}",
                "lastTimestamp": at.isoformat(), "involvedObject": {"kind": "Pod",
                                                                    "name": name}}

    found = troubles(None, [], [event("a", fresh), event("b", fresh - timedelta(hours=1)),
                                event("c", fresh)], {"a", "b"}, now=fresh)
    assert found == ["Pod a: FailedMount: no volume a"]
