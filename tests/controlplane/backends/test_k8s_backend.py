"""The Kubernetes backend driven by the reconciler, against the STAND-IN API server (kmock,
tests/k8s_emulator.py), with the tests playing the ReplicaSet controller, the scheduler and
the kubelets (ClusterPlayer): deployments become pods, pods become replica records, warm
standby pods are promoted by a label change, scale-downs pick their victims, troubles show
as conditions with the API server's or kubelet's words, and deletion removes everything
made for the deployment and nothing else."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import kmock
import pytest

from controlplane.backends.k8s_manifests import ROLE_LABEL
from controlplane.models import AuditEvent, Deployment, Replica
from controlplane.reconciler import Reconciler, pod_sets
from controlplane.routing import current_pools
from tests.controlplane.k8s_support import (
    backend_of,
    converge,
    deployment_factory,
    phases,
    rows,
)
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster, write_kubeconfig
from tests.processes import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def player(emulated: EmulatedCluster) -> ClusterPlayer:
    return ClusterPlayer(emulated.url)


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any, settings: Any) -> Callable[..., Deployment]:
    return deployment_factory(emulated, tmp_path, settings)


def test_a_deployment_becomes_pods_that_take_traffic_once_ready(
        make: Callable[..., Deployment], player: ClusterPlayer,
        emulated: EmulatedCluster) -> None:
    deployment = make(replicas=2)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] == 2
    assert emulated.stored("v1/services", "inference", "chat") is not None
    assert emulated.stored("policy/v1/poddisruptionbudgets", "inference", "chat") is not None
    assert player.sync() == ["chat-1", "chat-2"]
    converge(reconciler, lambda: len(rows(deployment)) == 2, "a replica per pod")
    assert {r.phase for r in rows(deployment)} == {Replica.Phase.PENDING}
    player.loading("chat-1", ip="10.1.0.1")
    converge(reconciler, lambda: phases(deployment)["chat-1"][0] == Replica.Phase.LOADING,
             "chat-1 loading")
    player.ready("chat-1", ip="10.1.0.1")
    player.ready("chat-2", ip="10.1.0.2")
    converge(reconciler, lambda: phases(deployment) == {
        "chat-1": ("ready", "active"), "chat-2": ("ready", "active")}, "both serving")
    # Promotion is a label on the pod, seen by anything that reads the cluster.
    assert all(p["metadata"]["labels"][ROLE_LABEL] == "active" for p in player.pods())
    replica = Replica.objects.get(name="chat-1")
    assert replica.endpoint == "http://10.1.0.1:8000" and replica.pod_name == "chat-1"
    assert "gpu-node-1" in replica.devices
    [pool] = current_pools()
    assert sorted(r.url for r in pool.replicas) == ["http://10.1.0.1:8000",
                                                    "http://10.1.0.2:8000"]
    deployment.refresh_from_db()
    assert deployment.is_ready()
    # A pass with nothing changed writes nothing: no API write, no event, no row.
    backend = backend_of(deployment)
    writes, events = backend.writes, AuditEvent.objects.count()
    for _ in range(3):
        assert reconciler.reconcile_all().changed == 0
    assert backend.writes == writes and AuditEvent.objects.count() == events


def test_a_warm_standby_is_promoted_by_a_label_change_and_refilled(
        make: Callable[..., Deployment], player: ClusterPlayer) -> None:
    deployment = make(replicas=1, standby=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    assert player.sync() == ["chat-1", "chat-2"]
    player.ready("chat-1", ip="10.1.0.1")
    player.ready("chat-2", ip="10.1.0.2")
    converge(reconciler, lambda: sorted(phases(deployment).values()) == [
        ("ready", "active"), ("ready", "standby")], "one active, one standby")
    [pool] = current_pools()
    assert len(pool.replicas) == 1  # the standby takes no traffic
    standby = Replica.objects.get(role=Replica.Role.STANDBY)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    reconciler.reconcile_all()
    # At once, in the same pass: the standby pod serves, same pod, no restart.
    promoted = Replica.objects.get(pk=standby.pk)
    assert (promoted.role, promoted.phase) == ("active", "ready")
    assert player.pod(standby.pod_name)["metadata"]["labels"][ROLE_LABEL] == "active"
    [pool] = current_pools()
    assert len(pool.replicas) == 2
    assert AuditEvent.objects.filter(action="replica-promoted",
                                     replica_name=standby.name).exists()
    # Then the pool is refilled: three pods, the new one standby once ready.
    assert player.sync() == ["chat-3"]
    player.ready("chat-3", ip="10.1.0.3")
    converge(reconciler, lambda: phases(deployment).get("chat-3") == ("ready", "standby"),
             "a new standby")


def test_a_scale_down_removes_the_standby_first_and_keeps_the_pool(
        make: Callable[..., Deployment], player: ClusterPlayer) -> None:
    deployment = make(replicas=2, standby=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.sync()
    for index, name in enumerate(["chat-1", "chat-2", "chat-3"], 1):
        player.ready(name, ip=f"10.1.0.{index}")
    converge(reconciler, lambda: sorted(phases(deployment).values()) == [
        ("ready", "active"), ("ready", "active"), ("ready", "standby")], "2 + 1")
    standby = Replica.objects.get(role=Replica.Role.STANDBY).name
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconciler.reconcile_all()
    # The standby was marked to go first, before the count was lowered...
    notes = player.pod(standby)["metadata"]["annotations"]
    assert int(notes["controller.kubernetes.io/pod-deletion-cost"]) < 0
    # ...and one active pod moved to the standby pool (a drained active one refills it).
    assert sorted(r.role for r in rows(deployment) if r.name != standby) == ["active",
                                                                            "standby"]
    player.sync()  # the ReplicaSet controller honours the cost
    assert standby not in player.names("chat")
    player.finish_terminating()
    converge(reconciler, lambda: len(rows(deployment)) == 2, "two replicas left")
    assert sorted(r.role for r in rows(deployment)) == ["active", "standby"]
    assert AuditEvent.objects.filter(action="replica-stopped", replica_name=standby).exists()


@pytest.mark.parametrize(("play", "expected"), [
    (lambda p: p.unschedulable("chat-1", "0/4 nodes are available: 4 Insufficient "
                                         "nvidia.com/gpu."),
     "Insufficient nvidia.com/gpu"),
    (lambda p: p.waiting("chat-1", "ImagePullBackOff",
                         'Back-off pulling image "vllm/vllm-openai:nope"'),
     "the image cannot be pulled"),
    (lambda p: p.waiting("chat-1", "CrashLoopBackOff", "back-off 5m0s", last="OOMKilled"),
     "OOMKilled"),
])
def test_pod_troubles_show_on_the_replica_and_the_deployment(
        make: Callable[..., Deployment], player: ClusterPlayer,
        play: Callable[[ClusterPlayer], None], expected: str) -> None:
    deployment = make(replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.sync()
    play(player)

    def degraded() -> str:
        deployment.refresh_from_db()
        condition = deployment.condition("Degraded") or {}
        return str(condition.get("message")) if condition.get("status") == "True" else ""

    message = converge(reconciler, degraded, "a Degraded condition")
    assert expected in message
    assert expected in Replica.objects.get().last_error
    # Once the cause is gone the replica serves and the condition clears.
    player.ready("chat-1")
    converge(reconciler, lambda: not degraded() and deployment.is_ready(), "recovered")


@pytest.mark.parametrize(("status", "reason", "message"), [
    (403, "Forbidden", "exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=1"),
    (401, "Unauthorized", "Unauthorized"),
    (409, "Conflict", 'Apply failed with 1 conflict: conflict with "kubectl-edit": '
                      '.spec.replicas'),
    (422, "Invalid", 'Deployment.apps "chat" is invalid: spec.template.spec.containers[0]'
                     '.resources.requests: Invalid value: "16Gi": must be less than or '
                     'equal to memory limit'),
])
def test_api_errors_show_back_off_and_converge(make: Callable[..., Deployment],
                                               emulated: EmulatedCluster, status: int,
                                               reason: str, message: str, settings: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The backoff's clock moves only when the test says: "within the backoff" holds
    # however slowly the machine runs the passes.
    skipped = [0.0]
    monkeypatch.setattr(pod_sets, "time", SimpleNamespace(
        monotonic=lambda: time.monotonic() + skipped[0]))
    settings.RESTART_BACKOFF_BASE_SECONDS = 60
    settings.RESTART_BACKOFF_MAX_SECONDS = 120

    def refuse_twice() -> None:
        assert emulated.emulator is not None
        emulated.emulator["patch", kmock.resource("apps/v1/deployments")][:2] << status << {
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status,
            "reason": reason, "message": message}

    emulated.call(refuse_twice)
    deployment = make(replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    deployment.refresh_from_db()
    degraded = deployment.condition("Degraded")
    assert degraded is not None and degraded["status"] == "True"
    assert f"HTTP {status}: applying Deployment chat: {message}" in degraded["message"]
    failed = AuditEvent.objects.filter(action="apply-failed")
    assert failed.count() == 1
    reconciler.reconcile_all()  # within the backoff: not tried again
    # The engine key's Secret, then the refused Deployment; nothing more.
    assert emulated.call(lambda: len(emulated.emulator["patch"])) == 2  # type: ignore[index]

    def applied() -> bool:
        skipped[0] += 121  # the next pass comes after the backoff, however long it is
        deployment.refresh_from_db()
        return (deployment.condition("Degraded") or {}).get("status") == "False"

    converge(reconciler, applied, "applied after the backoff")
    assert failed.count() == 1  # the same failure twice is one event
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] == 1
    assert emulated.call(lambda: len([  # one Deployment object: nothing duplicated
        key for key in emulated.emulator.objects  # type: ignore[union-attr]
        if "deployments" in str(key)])) == 1


def test_an_unreachable_api_server_changes_nothing_it_cannot_see(
        make: Callable[..., Deployment], player: ClusterPlayer, tmp_path: Any) -> None:
    deployment = make(replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.sync()
    player.ready("chat-1")
    converge(reconciler, lambda: phases(deployment) == {
        "chat-1": ("ready", "active")}, "serving")
    backend = deployment.backend
    backend.config = {**backend.config, "kubeconfig": write_kubeconfig(
        tmp_path / "gone", f"http://127.0.0.1:{free_port()}")}
    backend.save()
    reconciler.reconcile_all()
    deployment.refresh_from_db()
    degraded = deployment.condition("Degraded")
    assert degraded is not None and "cannot be reached" in degraded["message"]
    assert phases(deployment) == {"chat-1": ("ready", "active")}  # not concluded gone


def test_deleting_removes_everything_made_for_it_and_nothing_else(
        make: Callable[..., Deployment], player: ClusterPlayer,
        emulated: EmulatedCluster) -> None:
    deployment = make(replicas=2)
    other = make("other", replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.sync()
    converge(reconciler, lambda: len(rows(deployment)) == 2, "two replicas")
    Deployment.objects.filter(pk=deployment.pk).update(deleting=True)
    reconciler.reconcile_all()
    for resource in ("apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets"):
        assert emulated.stored(resource, "inference", "chat") is None
        assert emulated.stored(resource, "inference", "other") is not None
    assert Deployment.objects.filter(pk=deployment.pk).exists()  # its pods still end
    player.sync()  # the garbage collector takes the pods
    converge(reconciler, lambda: not Deployment.objects.filter(pk=deployment.pk).exists(),
             "the deployment removed")
    assert player.names("other") == ["other-3"]
    assert Replica.objects.filter(deployment=other).count() == 1
    assert AuditEvent.objects.filter(action="deleted").exists()


def test_pods_are_warmed_up_before_they_serve(
        make: Callable[..., Deployment], player: ClusterPlayer, fake_engines: Any) -> None:
    """Pods 'at' loopback addresses with a FAKE engine (fakes/engine.py) on the pod port:
    each gets one real completion before it is ready; one where nothing answers stays
    warming, says why, and takes no traffic."""
    deployment = make(replicas=1, standby=1)
    backend = deployment.backend
    backend.config = {**backend.config, "warm_up": True}
    backend.save()
    engines = [fake_engines(f"pod-{n}", model="chat", host=f"127.0.0.{n}", port=8000)
               for n in (21, 22)]
    reconciler = Reconciler()
    reconciler.reconcile_all()
    assert player.sync() == ["chat-1", "chat-2"]
    player.ready("chat-1", ip="127.0.0.21")
    player.ready("chat-2", ip="127.0.0.22")
    converge(reconciler, lambda: sorted(phases(deployment).values()) == [
        ("ready", "active"), ("ready", "standby")], "warmed: one active, one standby")
    for engine in engines:
        assert engine.metric("vllm:request_success_total") >= 1  # the warm-up request
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    reconciler.reconcile_all()
    [pool] = current_pools()
    assert sorted(r.url for r in pool.replicas) == ["http://127.0.0.21:8000",
                                                    "http://127.0.0.22:8000"]
    assert player.sync() == ["chat-3"]
    player.ready("chat-3", ip="127.0.0.23")  # nothing listens there
    converge(reconciler, lambda: "warm-up request failed" in Replica.objects.get(
        name="chat-3").last_error, "a failed warm-up shown")
    assert Replica.objects.get(name="chat-3").phase == Replica.Phase.WARMING
    [pool] = current_pools()
    assert len(pool.replicas) == 2


def test_an_api_server_older_than_1_30_is_refused_on_the_deployment(
        emulated: EmulatedCluster, tmp_path: Any, settings: Any) -> None:
    deployment = deployment_factory(emulated, tmp_path, settings, minor="29")(replicas=1)
    Reconciler().reconcile_all()
    deployment.refresh_from_db()
    degraded = deployment.condition("Degraded")
    assert degraded is not None and degraded["status"] == "True"
    assert ("the cluster runs Kubernetes 1.29; Fleetplane needs Kubernetes 1.30 or later"
            in degraded["message"])
    assert emulated.stored("apps/v1/deployments", "inference", "chat") is None
