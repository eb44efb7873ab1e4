"""Draining on a Kubernetes scale-down, against the STAND-IN API server (kmock) with the
tests playing the ReplicaSet controller and kubelets (ClusterPlayer): the pod chosen to go
leaves routing at once, finishes its streams, and only then is the count lowered (or at
its drain deadline). Pods 'at' loopback addresses run a FAKE engine (fakes/engine.py) on
the pod port, so in-flight counts come from its /metrics as from vLLM's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controlplane.models import AuditEvent, Deployment, Replica
from controlplane.reconciler import Reconciler
from controlplane.routing import current_pools, publish_routes
from serving.models import ApiKey
from tests.controlplane.k8s_support import backend_of, converge, deployment_factory, phases
from tests.engines import FakeEngine
from tests.factories import make_api_key
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def player(emulated: EmulatedCluster) -> ClusterPlayer:
    return ClusterPlayer(emulated.url)


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any, settings: Any) -> Callable[..., Deployment]:
    return deployment_factory(emulated, tmp_path, settings)


def stored_replicas(emulated: EmulatedCluster) -> int:
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None
    return int(stored["spec"]["replicas"])


def two_serving(make: Callable[..., Deployment], player: ClusterPlayer,
                reconciler: Reconciler, first: str = "10.1.0.1",
                second: str = "10.1.0.2") -> Deployment:
    deployment = make(replicas=2)
    reconciler.reconcile_all()
    assert player.sync() == ["chat-1", "chat-2"]
    player.ready("chat-1", ip=first)
    player.ready("chat-2", ip=second)
    converge(reconciler, lambda: phases(deployment) == {
        "chat-1": ("ready", "active"), "chat-2": ("ready", "active")}, "both serving")
    return deployment


def test_the_victim_leaves_routing_and_the_count_waits_for_its_streams(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        fake_engines: Callable[..., FakeEngine], gateway_url: str) -> None:
    engines = {name: fake_engines(name, model="chat", host=host, port=8000,
                                  interval_ms=50)
               for name, host in (("chat-1", "127.0.0.41"), ("chat-2", "127.0.0.42"))}
    reconciler = Reconciler()
    deployment = two_serving(make, player, reconciler, "127.0.0.41", "127.0.0.42")
    # Streams sent to the pods directly: one on chat-1 (about 2 s), three long ones on
    # chat-2, so the scale-down chooses chat-1, the less loaded.
    finished = threading.Event()

    def stream(url: str, tokens: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "chat", "prompt": "hi", "max_tokens": tokens, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
        finished.set()

    long_one = threading.Thread(target=stream, args=(engines["chat-1"].url, 40))
    long_one.start()
    busy = [threading.Thread(target=stream, args=(engines["chat-2"].url, 200))
            for _ in range(3)]
    for thread in busy:
        thread.start()
    converge(reconciler, lambda: backend_of(deployment).in_flight(
        Replica.objects.get(name="chat-1")) == 1 and backend_of(deployment).in_flight(
        Replica.objects.get(name="chat-2")) == 3, "streams running")
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconciler.reconcile_all()
    # chat-1 (one stream against three) was chosen: marked, out of routing at once...
    assert phases(deployment)["chat-1"][0] == Replica.Phase.DRAINING
    assert int(player.pod("chat-1")["metadata"]["annotations"][
        "controller.kubernetes.io/pod-deletion-cost"]) < 0
    [pool] = current_pools()
    assert [r.url for r in pool.replicas] == ["http://127.0.0.42:8000"]
    publish_routes()
    key = make_api_key(ApiKey.Scope.INFERENCE)
    before = engines["chat-1"].metric("fake:requests_total")
    for _ in range(4):
        answer = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": "chat", "prompt": "hi", "max_tokens": 1})
        assert answer.status_code == 200
    # ...so the gateway sends it nothing new, while its stream goes on...
    assert engines["chat-1"].metric("fake:requests_total") == before
    assert not finished.is_set()
    for _ in range(3):
        reconciler.reconcile_all()
        assert stored_replicas(emulated) == 2  # ...and the count waits for it
    # Once its stream is done the count is lowered, and the ReplicaSet removes chat-1.
    converge(reconciler, lambda: stored_replicas(emulated) == 1, "the count lowered",
             seconds=30)
    assert finished.is_set()
    assert AuditEvent.objects.filter(action="replica-drained", replica_name="chat-1",
                                     message__contains="finished its streams").exists()
    player.sync()
    assert player.names("chat") == ["chat-2"]
    long_one.join(30)
    for thread in busy:
        thread.join(60)


def test_the_count_is_lowered_at_the_drain_deadline_if_streams_go_on(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.DRAIN_TIMEOUT_SECONDS = 1
    reconciler = Reconciler()
    deployment = two_serving(make, player, reconciler)
    loads = {"chat-1": 5, "chat-2": 2}  # a stream that never ends on each
    monkeypatch.setattr(backend_of(deployment), "in_flight",
                        lambda replica: loads[replica.name])
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconciler.reconcile_all()
    assert phases(deployment)["chat-2"][0] == Replica.Phase.DRAINING  # the less loaded
    assert stored_replicas(emulated) == 2
    converge(reconciler, lambda: stored_replicas(emulated) == 1, "lowered at the deadline")
    assert AuditEvent.objects.filter(action="replica-drained", replica_name="chat-2",
                                     message__contains="drain deadline").exists()
    # Released once: later passes do not raise the count again.
    for _ in range(3):
        reconciler.reconcile_all()
        assert stored_replicas(emulated) == 1


def test_a_victim_is_kept_when_the_count_rises_before_it_goes(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    reconciler = Reconciler()
    deployment = two_serving(make, player, reconciler)
    monkeypatch.setattr(backend_of(deployment), "in_flight", lambda replica: 1)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    reconciler.reconcile_all()
    [victim] = [n for n, (phase, _) in phases(deployment).items() if phase == "draining"]
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    converge(reconciler, lambda: phases(deployment) == {
        "chat-1": ("ready", "active"), "chat-2": ("ready", "active")}, "both serving again")
    assert int(player.pod(victim)["metadata"]["annotations"][
        "controller.kubernetes.io/pod-deletion-cost"]) == 0
    assert stored_replicas(emulated) == 2
    assert AuditEvent.objects.filter(action="replica-kept", replica_name=victim).exists()


def test_a_pod_not_ready_goes_before_a_ready_standby(
        make: Callable[..., Deployment], player: ClusterPlayer,
        emulated: EmulatedCluster) -> None:
    """The ReplicaSet removes a pod that is not ready before any ready one, whatever its
    deletion cost: the control plane chooses the same pod (before a ready standby), so
    the ready ones stay and none is left marked and idle."""
    reconciler = Reconciler()
    deployment = make(replicas=2, standby=1)
    reconciler.reconcile_all()
    assert player.sync() == ["chat-1", "chat-2", "chat-3"]
    for number, name in enumerate(["chat-1", "chat-2", "chat-3"], start=1):
        player.ready(name, ip=f"10.1.0.{number}")
    converge(reconciler, lambda: sorted(role for phase, role in phases(deployment).values()
                                        if phase == "ready") == ["active", "active",
                                                                 "standby"],
             "two active, one standby")
    [active, *_] = sorted(n for n, (_, role) in phases(deployment).items() if role == "active")
    player.loading(active, ip="10.1.0.9")  # restarting: not ready for a while
    converge(reconciler, lambda: phases(deployment)[active][0] != "ready", "one not ready")
    Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
    converge(reconciler, lambda: stored_replicas(emulated) == 2, "the count lowered")
    chosen = AuditEvent.objects.get(action="replica-chosen")
    assert chosen.message.startswith(f"{active} goes at the scale-down")
    player.sync()
    player.finish_terminating()
    converge(reconciler, lambda: active not in phases(deployment) and all(
        phase == "ready" for phase, _ in phases(deployment).values()), "the ready two stay")
    assert sorted(role for _, role in phases(deployment).values()) == ["active", "standby"]
    assert not AuditEvent.objects.filter(action="replica-kept").exists()
