"""Drift: a live object changed behind the control plane's back (`kubectl scale`,
`kubectl edit`) is found by comparing it with the rendered one field by field, put back by
the next apply, and told as an event naming the field, the values and, from
managedFields, who changed it. Against the STAND-IN API server (kmock), where the tests
play kubectl through the official client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from controlplane.backends.k8s_drift import describe, differences, owners
from controlplane.models import AuditEvent, Deployment
from controlplane.reconciler import Reconciler
from tests.controlplane.k8s_support import backend_of, converge, deployment_factory, rows
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster


@pytest.fixture
def player(emulated: EmulatedCluster) -> ClusterPlayer:
    return ClusterPlayer(emulated.url)


@pytest.fixture
def make(emulated: EmulatedCluster, tmp_path: Any, settings: Any) -> Callable[..., Deployment]:
    return deployment_factory(emulated, tmp_path, settings)


def managed_by(manager: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """metadata.managedFields as the API server writes them after an update."""
    return [{"manager": "fleetplane", "operation": "Apply", "apiVersion": "apps/v1",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {}}}},
            {"manager": manager, "operation": "Update", "apiVersion": "apps/v1",
             "fieldsType": "FieldsV1", "fieldsV1": fields}]


def live_deployment(emulated: EmulatedCluster) -> dict[str, Any]:
    stored = emulated.stored("apps/v1/deployments", "inference", "chat")
    assert stored is not None
    return stored


@pytest.mark.django_db
def test_kubectl_scale_is_put_back_and_told_with_who_did_it(
        make: Callable[..., Deployment], player: ClusterPlayer,
        emulated: EmulatedCluster) -> None:
    deployment = make(replicas=2)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    player.sync(ready=True)
    converge(reconciler, lambda: len(rows(deployment)) == 2, "two pods")
    player.kubectl_scale("chat", 5)  # the stand-in records kubectl as its manager
    converge(reconciler, lambda: live_deployment(emulated)["spec"]["replicas"] == 2,
             "the count put back")
    [drift] = AuditEvent.objects.filter(action="drift")
    assert drift.message == ("drift: spec.replicas was 5 (kubectl), put back to 2; the "
                             "field taken back from kubectl")
    # Put back once: passes with nothing changed write nothing and tell nothing more.
    backend = backend_of(deployment)
    writes = backend.writes
    for _ in range(3):
        reconciler.reconcile_all()
    assert backend.writes == writes
    assert AuditEvent.objects.filter(action="drift").count() == 1


@pytest.mark.django_db
def test_kubectl_edit_of_the_image_and_env_is_put_back(
        make: Callable[..., Deployment], player: ClusterPlayer,
        emulated: EmulatedCluster) -> None:
    make(replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    template = live_deployment(emulated)["spec"]["template"]
    [container] = template["spec"]["containers"]
    image = container["image"]
    edited = {**container, "image": "evil/miner:latest",
              "env": [*container["env"], {"name": "EXTRA", "value": "1"}]}
    player.kubectl_patch("chat", {"spec": {"template": {"spec": {"containers": [edited]}}}},
                         manager="kubectl-edit")
    converge(reconciler, lambda: live_deployment(emulated)["spec"]["template"]["spec"][
        "containers"][0]["image"] == image, "the image put back")
    assert [c["name"] for c in live_deployment(emulated)["spec"]["template"]["spec"][
        "containers"][0]["env"]] == [e["name"] for e in container["env"]]
    [drift] = AuditEvent.objects.filter(action="drift")
    assert (f'spec.template.spec.containers[vllm].image was "evil/miner:latest" '
            f'(kubectl-edit), put back to "{image}"') in drift.message
    assert "spec.template.spec.containers[vllm].env was" in drift.message
    assert "taken back from kubectl-edit" in drift.message


def test_the_comparison_ignores_what_the_server_adds_and_compares_quantities() -> None:
    wanted = {"spec": {"replicas": 2, "template": {"spec": {"containers": [
        {"name": "vllm", "image": "a:1", "resources": {"limits": {"cpu": "1.5"}}}]}}}}
    live: dict[str, Any] = {"spec": {"replicas": 2, "revisionHistoryLimit": 10,
                                     "template": {"spec": {
        "containers": [{"name": "vllm", "image": "a:1", "imagePullPolicy": "Always",
                        "resources": {"limits": {"cpu": "1500m"}}}],
        "dnsPolicy": "ClusterFirst"}}}, "status": {"readyReplicas": 2}}
    assert differences(wanted, live) == []
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2"
    [found] = differences(wanted, live)
    assert found.path == "spec.template.spec.containers[vllm].resources.limits.cpu"
    assert (found.live, found.wanted) == ("2", "1.5")


def test_a_list_of_another_length_differs_as_a_whole() -> None:
    [found] = differences({"args": ["--a", "--b"]}, {"args": ["--a"]})
    assert found.path == "args" and found.live == ["--a"]


def test_who_changed_a_field_comes_from_managed_fields() -> None:
    wanted = {"spec": {"template": {"spec": {"containers": [{"name": "vllm",
                                                              "args": ["--x"]}]}}}}
    live = {"metadata": {"managedFields": managed_by("helm", {"f:spec": {"f:template": {
        "f:spec": {"f:containers": {'k:{"name":"vllm"}': {"f:args": {}}}}}}})},
        "spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": ["--y"]}]}}}}
    [found] = differences(wanted, live)
    assert owners(live, found) == ["helm"]


def test_a_secrets_values_are_never_shown() -> None:
    live = {"data": {"VLLM_API_KEY": "b2xk"}}
    found = differences({"data": {"VLLM_API_KEY": "bmV3"}}, live)
    text, _ = describe("Secret", "chat-engine-key", found, live, ours=("fleetplane",),
                       main=False)
    assert text == ("drift: Secret chat-engine-key: data.VLLM_API_KEY changed (value "
                    "hidden), put back")
    assert "b2xk" not in text and "bmV3" not in text
