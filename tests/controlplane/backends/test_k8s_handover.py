"""Who owns `spec.replicas`, against the STAND-IN API server (kmock): switching an existing
deployment to an autoscaler (HPA) hands the field over at its live value, under a separate
field manager, before the backend's own apply drops it (Kubernetes' documented way), and
switching back, or stopping, removes the autoscaler before any count is applied. The live
count is read after every request: it is never the default of 1 in between."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from controlplane.backends.k8s_client import Cluster
from controlplane.models import AuditEvent, Deployment
from controlplane.reconciler import Reconciler
from tests.controlplane.k8s_support import converge, deployment_factory, rows
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster

pytestmark = pytest.mark.django_db


@pytest.fixture
def player(emulated: EmulatedCluster) -> ClusterPlayer:
    return ClusterPlayer(emulated.url)


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any, settings: Any) -> Callable[..., Deployment]:
    return deployment_factory(emulated, tmp_path, settings)


Step = tuple[str, str, str, Any, Any]  # request, kind, manager, replicas sent, live after


@pytest.fixture
def steps(emulated: EmulatedCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Step]]:
    """Every apply and delete the backend sends, with the live count read right after."""
    seen: list[Step] = []
    apply, delete = Cluster.apply, Cluster.delete

    def live() -> Any:
        stored = emulated.stored("apps/v1/deployments", "inference", "chat")
        return None if stored is None else stored["spec"].get("replicas")

    def applying(self: Cluster, obj: dict[str, Any], **options: Any) -> None:
        apply(self, obj, **options)
        seen.append(("apply", obj["kind"], options.get("manager", "fleetplane"),
                     (obj.get("spec") or {}).get("replicas", "-"), live()))

    def deleting(self: Cluster, kind: str, name: str, **options: Any) -> None:
        delete(self, kind, name, **options)
        seen.append(("delete", kind, "", "-", live()))

    monkeypatch.setattr(Cluster, "apply", applying)
    monkeypatch.setattr(Cluster, "delete", deleting)
    yield seen


def switch(deployment: Deployment, scaling: str) -> None:
    backend = deployment.backend
    backend.config = {**backend.config, "scaling": scaling}
    backend.save()


def three_serving(make: Callable[..., Deployment], player: ClusterPlayer,
                  reconciler: Reconciler) -> Deployment:
    deployment = make(replicas=3, min_replicas=1, max_replicas=6)
    reconciler.reconcile_all()
    player.sync(ready=True)
    converge(reconciler, lambda: len(rows(deployment)) == 3, "three pods")
    return deployment


def test_switching_to_an_autoscaler_hands_the_live_count_over(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    steps.clear()
    switch(deployment, "hpa")
    reconciler.reconcile_all()
    deployments = [s for s in steps if s[1] == "Deployment"]
    # First only spec.replicas, at its live value, under the handover manager; then the
    # backend's own apply without the field.
    assert deployments == [("apply", "Deployment", "fleetplane-handover", 3, 3),
                           ("apply", "Deployment", "fleetplane", "-", 3)]
    assert [s[4] for s in steps] == [3] * len(steps)  # never 1 after any request
    assert emulated.stored("autoscaling/v2/horizontalpodautoscalers", "inference",
                           "chat") is not None
    assert AuditEvent.objects.filter(action="handover",
                                     message__contains="live value, 3").exists()
    # The HPA sets the count from here on; the backend never puts it back.
    player.apps.patch_namespaced_deployment_scale(
        "chat", "inference", {"spec": {"replicas": 5}},
        _content_type="application/merge-patch+json")
    steps.clear()
    for _ in range(3):
        reconciler.reconcile_all()
    assert steps == []
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] == 5
    assert not AuditEvent.objects.filter(action="drift").exists()


def test_switching_back_removes_the_autoscaler_before_the_count_is_applied(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    switch(deployment, "hpa")
    reconciler.reconcile_all()
    steps.clear()
    switch(deployment, "controlplane")
    reconciler.reconcile_all()
    kinds = [(s[0], s[1]) for s in steps]
    assert kinds.index(("delete", "HorizontalPodAutoscaler")) < kinds.index(
        ("apply", "Deployment"))
    assert [s[4] for s in steps] == [3] * len(steps)
    assert emulated.stored("autoscaling/v2/horizontalpodautoscalers", "inference",
                           "chat") is None
    assert AuditEvent.objects.filter(action="autoscaler-removed").exists()


def test_stopping_removes_the_autoscaler_before_scaling_to_zero(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    switch(deployment, "hpa")
    reconciler.reconcile_all()
    steps.clear()
    Deployment.objects.filter(pk=deployment.pk).update(state=Deployment.State.STOPPED)
    converge(reconciler, lambda: emulated.stored(
        "apps/v1/deployments", "inference", "chat")["spec"]["replicas"] == 0,  # type: ignore[index]
        "scaled to zero")
    requests = [(s[0], s[1], s[3]) for s in steps]
    assert requests.index(("delete", "HorizontalPodAutoscaler", "-")) < requests.index(
        ("apply", "Deployment", 0))
    assert 1 not in [s[4] for s in steps]


def test_the_hpa_keda_makes_for_a_scaled_object_is_left_alone(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    """KEDA copies its ScaledObject's labels (ours) onto the HPA it makes; that HPA is
    KEDA's (ownerReferences), not a stale autoscaler of ours to remove every pass."""
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    switch(deployment, "keda")
    reconciler.reconcile_all()
    hpa = player.keda_hpa("chat")
    steps.clear()
    for _ in range(3):
        reconciler.reconcile_all()
    assert emulated.stored("autoscaling/v2/horizontalpodautoscalers", "inference",
                           hpa) is not None
    assert [s for s in steps if s[0] == "delete"] == []
    assert not AuditEvent.objects.filter(action="autoscaler-removed").exists()


def test_a_deployment_started_again_under_an_hpa_is_handed_over_at_its_minimum(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    """Stopped, it went to 0 with the HPA removed; started again, the count handed over
    is the HPA's minimum, not 0 (at 0 an HPA disables scaling and never raises it)."""
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    switch(deployment, "hpa")
    reconciler.reconcile_all()
    Deployment.objects.filter(pk=deployment.pk).update(state=Deployment.State.STOPPED)
    converge(reconciler, lambda: emulated.stored(
        "apps/v1/deployments", "inference", "chat")["spec"]["replicas"] == 0,  # type: ignore[index]
        "scaled to zero")
    steps.clear()
    Deployment.objects.filter(pk=deployment.pk).update(state=Deployment.State.RUNNING)
    reconciler.reconcile_all()
    hpa = emulated.stored("autoscaling/v2/horizontalpodautoscalers", "inference", "chat")
    assert hpa is not None and hpa["spec"]["minReplicas"] == 1
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] >= 1
    handovers = [s for s in steps if s[2] == "fleetplane-handover"]
    assert handovers and handovers[0][3] == 1
    assert AuditEvent.objects.filter(action="handover",
                                     message__contains="its minimum, 1 (it was 0)").exists()


def test_the_control_planes_count_of_zero_keeps_keda_in_place(
        make: Callable[..., Deployment], player: ClusterPlayer, emulated: EmulatedCluster,
        steps: list[Step]) -> None:
    """A running deployment whose count is 0 under KEDA keeps its ScaledObject: KEDA owns
    scaling to and from zero; only stopping removes it."""
    reconciler = Reconciler()
    deployment = three_serving(make, player, reconciler)
    switch(deployment, "keda")
    reconciler.reconcile_all()
    Deployment.objects.filter(pk=deployment.pk).update(replicas=0)
    for _ in range(3):
        reconciler.reconcile_all()
    assert emulated.stored("keda.sh/v1alpha1/scaledobjects", "inference", "chat") is not None
    assert not AuditEvent.objects.filter(action="autoscaler-removed").exists()
