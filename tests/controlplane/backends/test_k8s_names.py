"""Names and selectors end to end, against the STAND-IN API server (kmock,
tests/k8s_emulator.py) with the tests playing the ReplicaSet controller: a deployment whose
name cannot name a Service as it is still serves, and another install's objects in the
same namespace are never adopted or deleted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from controlplane.backends.k8s_client import Cluster, api_client
from controlplane.backends.k8s_manifests import KubernetesConfig, object_name, render
from controlplane.models import Deployment, Replica
from controlplane.reconciler import Reconciler
from tests.factories import make_backend, make_deployment, make_model
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster, write_kubeconfig

pytestmark = pytest.mark.django_db


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any) -> Callable[..., Deployment]:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emulated.url)
    record = make_backend("gpus", "kubernetes", {
        "namespace": "inference", "kubeconfig": kubeconfig, "model_source": "pvc",
        "pvc_name": "models", "warm_up": False})
    model = make_model("llama")

    def create(name: str, **fields: Any) -> Deployment:
        return cast(Deployment, make_deployment(name, model=model, backend=record, **fields))

    return create


def converge(reconciler: Reconciler, check: Callable[[], Any], what: str,
             seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while True:
        result = reconciler.reconcile_all()
        assert not result.errors, result.errors
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


def ready_replicas(deployment: Deployment) -> list[str]:
    return sorted(r.name for r in Replica.objects.filter(deployment=deployment,
                                                         phase=Replica.Phase.READY))


def test_a_name_starting_with_a_digit_serves_under_its_service_name(
        make: Callable[..., Deployment], emulated: EmulatedCluster) -> None:
    deployment = make("8b-chat", replicas=1)
    player = ClusterPlayer(emulated.url)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    name = object_name("8b-chat")
    assert name.startswith("d-8b-chat-")
    for resource in ("apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets",
                     "networking.k8s.io/v1/networkpolicies"):
        assert emulated.stored(resource, "inference", name) is not None, resource
    assert emulated.stored("v1/secrets", "inference", f"{name}-engine-key") is not None
    [pod] = player.sync()
    player.ready(pod, ip="10.1.0.7")
    converge(reconciler, lambda: ready_replicas(deployment) == [pod], "the pod serving")


def test_another_install_in_the_namespace_is_left_alone(
        make: Callable[..., Deployment], emulated: EmulatedCluster, settings: Any) -> None:
    ours = make("chat", replicas=2)
    config = KubernetesConfig.from_dict({"namespace": "inference", "model_source": "pvc",
                                         "pvc_name": "models"})
    # The other install has a deployment of the same name, applied under its own id.
    settings.INSTALL_ID = "staging"
    cluster = Cluster(config, api_client(config, emulated.url))
    for obj in render(ours, config):
        cluster.apply(obj)
    settings.INSTALL_ID = "fleetplane"
    # And a pod of theirs that carries our instance label: only the install tells it apart.
    from kubernetes import client

    stray = client.V1Pod.from_dict({"metadata": {
        "name": "theirs-1", "namespace": "inference", "labels": {
            "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/managed-by": "fleetplane", "fleetplane.io/install": "staging"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}})
    assert stray is not None
    client.CoreV1Api(cluster.client).create_namespaced_pod("inference", stray)
    player = ClusterPlayer(emulated.url)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    # (The stand-in ReplicaSet controller counts their pod as one of two: one more.)
    [mine] = [name for name in player.sync() if name.startswith("chat-")]
    assert player.names("staging-chat")
    converge(reconciler, lambda: Replica.objects.filter(deployment=ours).exists(),
             "a replica for our pod")
    # Theirs are not ours: no replica for their pods, and deleting ours leaves theirs.
    assert [r.pod_name for r in Replica.objects.all()] == [mine]
    Deployment.objects.filter(pk=ours.pk).update(deleting=True)
    reconciler.reconcile_all()
    assert emulated.stored("apps/v1/deployments", "inference", "chat") is None
    for resource in ("apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets"):
        assert emulated.stored(resource, "inference", "staging-chat") is not None, resource
    assert emulated.stored("v1/secrets", "inference", "staging-chat-engine-key") is not None


def test_a_deployment_an_older_version_applied_is_created_again_with_the_new_selector(
        make: Callable[..., Deployment], emulated: EmulatedCluster) -> None:
    """Before the install label, objects selected by the database id; `spec.selector` is
    immutable (the stand-in answers 422 as the API server does), so that Deployment is
    deleted and created again, and the deployment serves."""
    deployment = make("chat", replicas=1)
    player = ClusterPlayer(emulated.url)
    old_labels = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
                  "app.kubernetes.io/managed-by": "fleetplane",
                  "fleetplane.io/deployment-id": str(deployment.pk)}
    player.apps.create_namespaced_deployment("inference", cast(Any, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "inference", "labels": old_labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": old_labels},
                 "template": {"metadata": {"labels": old_labels},
                              "spec": {"containers": [{"name": "vllm",
                                                       "image": "vllm/vllm-openai:v0.1"}]}}}}))
    reconciler = Reconciler()
    reconciler.reconcile_all()
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None
    assert stored["spec"]["selector"]["matchLabels"].get("fleetplane.io/install") == \
        "fleetplane"
    assert "fleetplane.io/deployment-id" not in stored["spec"]["selector"]["matchLabels"]
    from controlplane.models import AuditEvent

    [note] = AuditEvent.objects.filter(action="recreated")
    assert "another selector" in note.message
    player.sync(ready=True)
    converge(reconciler, lambda: len(ready_replicas(deployment)) == 1, "a replica serves")


def test_another_installs_deployment_of_the_same_name_is_never_recreated(
        make: Callable[..., Deployment], emulated: EmulatedCluster) -> None:
    make("chat", replicas=1)
    player = ClusterPlayer(emulated.url)
    theirs = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
              "app.kubernetes.io/managed-by": "fleetplane",
              "fleetplane.io/install": "other"}
    player.apps.create_namespaced_deployment("inference", cast(Any, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "inference", "labels": theirs},
        "spec": {"replicas": 1, "selector": {"matchLabels": theirs},
                 "template": {"metadata": {"labels": theirs},
                              "spec": {"containers": [{"name": "vllm",
                                                       "image": "vllm/vllm-openai:v0.1"}]}}}}))
    Reconciler().reconcile_all()
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None
    assert stored["metadata"]["labels"]["fleetplane.io/install"] == "other"
    deployment = Deployment.objects.get(name="chat")
    assert "immutable" in str(deployment.conditions)


def test_a_name_that_is_anothers_object_name_is_refused(admin_client: Any) -> None:
    make_model("llama")
    first = admin_client.post("/api/v1/deployments/", {
        "name": "8b-chat", "model": "llama", "replicas": 1}, format="json")
    assert first.status_code == 201, first.json()
    taken = object_name("8b-chat")
    second = admin_client.post("/api/v1/deployments/", {
        "name": taken, "model": "llama", "replicas": 1}, format="json")
    assert second.status_code == 409, second.json()
    assert "8b-chat" in str(second.json()) and taken in str(second.json())
    assert Deployment.objects.filter(name=taken).count() == 0


def test_an_older_deployment_still_terminating_is_waited_for_quietly(
        make: Callable[..., Deployment], emulated: EmulatedCluster,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real cluster the old Deployment stays (terminating) until its pods are gone:
    the create is tried again each pass, told once, with no apply failure meanwhile."""
    from controlplane.models import AuditEvent

    deployment = make("chat", replicas=1)
    player = ClusterPlayer(emulated.url)
    old_labels = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "chat",
                  "app.kubernetes.io/managed-by": "fleetplane",
                  "fleetplane.io/deployment-id": str(deployment.pk)}
    player.apps.create_namespaced_deployment("inference", cast(Any, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "inference", "labels": old_labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": old_labels},
                 "template": {"metadata": {"labels": old_labels},
                              "spec": {"containers": [{"name": "vllm",
                                                       "image": "vllm/vllm-openai:v0.1"}]}}}}))

    def terminating(self: Cluster, kind: str, name: str, **options: Any) -> None:
        player.apps.patch_namespaced_deployment(name, "inference", {"metadata": {
            "deletionTimestamp": "2026-01-01T00:00:00Z"}},
            _content_type="application/merge-patch+json")

    monkeypatch.setattr(Cluster, "delete", terminating)
    reconciler = Reconciler()
    for _ in range(3):
        reconciler.reconcile_all()
    [told] = AuditEvent.objects.filter(action="recreated")
    assert "created again once it is gone" in told.message
    assert not AuditEvent.objects.filter(action="apply-failed").exists()
    player.apps.delete_namespaced_deployment("chat", "inference")  # its pods are gone
    reconciler.reconcile_all()
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None
    assert stored["spec"]["selector"]["matchLabels"].get("fleetplane.io/install") == \
        "fleetplane"
    assert not AuditEvent.objects.filter(action="apply-failed").exists()
