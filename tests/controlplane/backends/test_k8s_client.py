"""The Kubernetes backend's API calls with the official client against the STAND-IN API
server (tests/k8s_emulator.py: kmock): apply creates then updates, only owned objects are
removed, API errors carry the server's status and message, an unreachable server is named."""

from __future__ import annotations

from typing import Any

import kmock
import pytest

from controlplane.backends.k8s_client import (
    DELETION_COST,
    Cluster,
    ClusterError,
    api_client,
)
from controlplane.backends.k8s_manifests import KubernetesConfig, owner_labels, render
from tests.controlplane.k8s_support import serve_version
from tests.factories import make_deployment, make_model
from tests.k8s_emulator import EmulatedCluster
from tests.processes import free_port

pytestmark = pytest.mark.django_db

CONFIG = KubernetesConfig.from_dict({"namespace": "inference"})


@pytest.fixture
def cluster(emulated: EmulatedCluster) -> Cluster:
    return Cluster(CONFIG, api_client(CONFIG, emulated.url))


@pytest.fixture
def deployment() -> Any:
    model = make_model("llama", source="huggingface", source_uri="org/llama")
    return make_deployment("chat", model=model, replicas=2)


def test_apply_creates_then_updates_every_object(cluster: Cluster, emulated: EmulatedCluster,
                                                 deployment: Any) -> None:
    for obj in render(deployment, CONFIG):
        cluster.apply(obj)
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] == 2
    assert emulated.stored("v1/services", "inference", "chat") is not None
    assert emulated.stored("policy/v1/poddisruptionbudgets", "inference", "chat") is not None
    deployment.replicas = 3
    cluster.apply(render(deployment, CONFIG)[1])  # the apps/v1 Deployment
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None and stored["spec"]["replicas"] == 3


def test_removal_takes_what_was_made_for_the_deployment_and_nothing_else(
        cluster: Cluster, emulated: EmulatedCluster, deployment: Any) -> None:
    other = make_deployment("other", model=deployment.model, backend=deployment.backend)
    for obj in render(deployment, CONFIG) + render(other, CONFIG):
        cluster.apply(obj)
    stranger = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "stranger", "namespace": "inference",
                             "labels": {"app.kubernetes.io/instance": "chat"}},
                "spec": {"ports": [{"port": 80}]}}
    cluster.apply(stranger)  # shares one label with the deployment's objects, not all
    assert cluster.delete_owned(owner_labels(deployment)) == 5
    assert emulated.stored("apps/v1/deployments", "inference", "chat") is None
    assert emulated.stored("v1/secrets", "inference", "chat-engine-key") is None
    assert emulated.stored("v1/secrets", "inference", "other-engine-key") is not None
    assert emulated.stored("apps/v1/deployments", "inference", "other") is not None
    assert emulated.stored("v1/services", "inference", "stranger") is not None
    assert cluster.delete_owned(owner_labels(deployment)) == 0  # again: nothing left


def test_pods_are_read_as_plain_objects_and_marked_for_scale_down(
        cluster: Cluster, emulated: EmulatedCluster, deployment: Any) -> None:
    from kubernetes import client

    labels = owner_labels(deployment)
    core = client.CoreV1Api(cluster.client)
    for name, pod_labels in (("chat-a", labels), ("chat-b", labels),
                             ("unrelated", {"app": "x"})):
        # What the ReplicaSet controller would create (the tests play it here).
        pod = client.V1Pod.from_dict({"metadata": {
            "name": name, "namespace": "inference", "labels": pod_labels},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}})
        assert pod is not None
        core.create_namespaced_pod("inference", pod)
    pods, _ = cluster.list_pods(labels)
    assert sorted(p["metadata"]["name"] for p in pods) == ["chat-a", "chat-b"]
    cluster.set_deletion_cost("chat-b", -100)
    stored = emulated.stored("v1/pods", "inference", "chat-b")
    assert stored is not None
    assert stored["metadata"]["annotations"][DELETION_COST] == "-100"


@pytest.mark.parametrize(("status", "reason", "message"), [
    (401, "Unauthorized", "Unauthorized"),
    (403, "Forbidden", 'deployments.apps "chat" is forbidden: User "fleetplane" cannot patch'),
    (409, "Conflict", "Apply failed with 1 conflict: conflict with \"kubectl\""),
    (422, "Invalid", "spec.template.spec.containers[0].image: Required value"),
    (403, "Forbidden", 'exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=2'),
])
def test_api_errors_carry_the_servers_status_and_message(
        cluster: Cluster, emulated: EmulatedCluster, deployment: Any, status: int,
        reason: str, message: str) -> None:
    def refuse() -> None:
        assert emulated.emulator is not None
        emulated.emulator["patch", kmock.resource("apps/v1/deployments")] << status << {
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status,
            "reason": reason, "message": message}

    emulated.call(refuse)
    with pytest.raises(ClusterError) as caught:
        cluster.apply(render(deployment, CONFIG)[1])  # the apps/v1 Deployment
    assert caught.value.status == status
    assert str(caught.value) == f"HTTP {status}: applying Deployment chat: {message}"


def test_an_unreachable_api_server_is_named(deployment: Any) -> None:
    nowhere = Cluster(CONFIG, api_client(CONFIG, f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(ClusterError) as caught:
        nowhere.apply(render(deployment, CONFIG)[1])  # the apps/v1 Deployment
    assert caught.value.status == 0
    assert "the API server cannot be reached" in str(caught.value)


def test_no_kubeconfig_is_a_clear_error(tmp_path: Any) -> None:
    config = KubernetesConfig.from_dict({"namespace": "a",
                                         "kubeconfig": str(tmp_path / "missing")})
    with pytest.raises(ClusterError, match="no Kubernetes configuration"):
        api_client(config)


def test_the_servers_version_is_read(cluster: Cluster, emulated: EmulatedCluster) -> None:
    serve_version(emulated, "33")
    assert cluster.server_version()["minor"] == "33"
