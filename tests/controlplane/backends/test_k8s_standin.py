"""The STAND-IN Kubernetes API server (tests/k8s_emulator.py, kmock wrapped) behaves like
Kubernetes where the backend depends on it, seen through the official `kubernetes` client as
the backend uses it: label selectors in list and watch, resourceVersions and 410 Gone,
names and an immutable Deployment selector refused 422, server-side apply conflicts and
field ownership, and RBAC authorization against the Roles of deploy/kubernetes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.leader import LeaseElection
from tests.k8s_emulator import CONTROLLER, ClusterPlayer, EmulatedCluster, write_kubeconfig

NS = "inference"
SELECTOR = {"app.kubernetes.io/instance": "chat"}


def controller_client(emulated: EmulatedCluster, tmp_path: Path) -> Any:
    """An ApiClient with the controller's credentials, loaded as the backend loads them."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=write_kubeconfig(tmp_path / "kubeconfig",
                                                         emulated.url),
                            client_configuration=configuration)
    return client.ApiClient(configuration)


@pytest.fixture
def core(emulated: EmulatedCluster) -> Any:
    """The core API without a token: not checked (a cluster admin's calls)."""
    from kubernetes import client

    return client.CoreV1Api(client.ApiClient(client.Configuration(host=emulated.url)))


@pytest.fixture
def apps(emulated: EmulatedCluster, tmp_path: Path) -> Any:
    from kubernetes import client

    return client.AppsV1Api(controller_client(emulated, tmp_path))


def pod(name: str, labels: dict[str, str]) -> Any:
    from kubernetes import client

    return client.V1Pod.from_dict({
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}})


def deployment(name: str = "chat", replicas: int | None = 2,
               selector: dict[str, str] | None = None) -> dict[str, Any]:
    labels = selector or SELECTOR
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": {"containers": [
            {"name": "vllm", "image": "vllm/vllm-openai"}]}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def apply(apps: Any, body: dict[str, Any], force: bool = True) -> Any:
    """Server-side apply, as the backend sends it."""
    return apps.patch_namespaced_deployment(
        body["metadata"]["name"], NS, body, field_manager="fleetplane", force=force,
        _content_type="application/apply-patch+yaml")


def refusal(call: Any, *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as caught:
        call(*args, **kwargs)
    return int(caught.value.status), json.loads(caught.value.body or "{}")


def replicas_owners(emulated: EmulatedCluster, name: str = "chat") -> list[str]:
    found: Any = ClusterPlayer(emulated.url).apps.read_namespaced_deployment(name, NS)
    return sorted(str(entry.manager) for entry in found.metadata.managed_fields or []
                  if "f:replicas" in ((entry.fields_v1 or {}).get("f:spec") or {}))


def watched(core: Any, resource_version: str, selector: str = "", count: int = 1
            ) -> list[tuple[str, str]]:
    """(type, name or error code) of the first `count` events of a pod watch from
    resource_version, read as the backend reads its watch."""
    response = core.list_namespaced_pod(NS, watch=True, label_selector=selector,
                                        resource_version=resource_version,
                                        timeout_seconds=5, _preload_content=False)
    events: list[tuple[str, str]] = []
    try:
        for line in response:  # one JSON event per line
            event = json.loads(line)
            obj = event["object"]
            events.append((event["type"], str(obj.get("code") or obj["metadata"]["name"])))
            if len(events) == count:
                break
    finally:
        response.release_conn()
    return events


# --- label selectors ------------------------------------------------------------------


@pytest.mark.parametrize(("selector", "names"), [
    ("app=chat", ["chat-a", "chat-b"]),
    ("app==chat,role=standby", ["chat-b"]),
    ("app!=chat", ["bare", "embed-a"]),
    ("role", ["chat-a", "chat-b", "embed-a"]),
    ("!role", ["bare"]),
    ("app in (chat, embed)", ["chat-a", "chat-b", "embed-a"]),
    ("app notin (chat),role", ["embed-a"]),
])
def test_a_list_returns_only_what_its_label_selector_selects(
        emulated: EmulatedCluster, core: Any, selector: str, names: list[str]) -> None:
    for name, labels in (("chat-a", {"app": "chat", "role": "active"}),
                         ("chat-b", {"app": "chat", "role": "standby"}),
                         ("embed-a", {"app": "embed", "role": "active"}),
                         ("bare", {})):
        core.create_namespaced_pod(NS, pod(name, labels))
    found = core.list_namespaced_pod(NS, label_selector=selector)
    assert sorted(p.metadata.name for p in found.items) == names


def test_a_malformed_label_selector_is_a_bad_request(core: Any) -> None:
    status, body = refusal(core.list_namespaced_pod, NS, label_selector="app in (chat")
    assert status == 400 and body["reason"] == "BadRequest"
    assert "unable to parse requirement" in body["message"]


def test_a_watch_sees_objects_enter_and_leave_its_label_selector(core: Any) -> None:
    core.create_namespaced_pod(NS, pod("chat-a", {"app": "chat"}))
    start = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod("other", {"app": "other"}))  # never seen
    core.patch_namespaced_pod("chat-a", NS, {"metadata": {"labels": {"app": "gone"}}})
    core.patch_namespaced_pod("other", NS, {"metadata": {"labels": {"app": "chat"}}})
    assert watched(core, start, "app=chat", count=2) == [
        ("DELETED", "chat-a"), ("ADDED", "other")]


# --- resourceVersion and 410 Gone -----------------------------------------------------


def test_every_change_gets_a_newer_resource_version_and_a_watch_resumes_after_one(
        core: Any) -> None:
    created = core.create_namespaced_pod(NS, pod("chat-a", {"app": "chat"}))
    patched = core.patch_namespaced_pod("chat-a", NS, {"metadata": {"annotations": {
        "controller.kubernetes.io/pod-deletion-cost": "-1000"}}})
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    listed = core.list_namespaced_pod(NS)
    assert listed.metadata.resource_version == patched.metadata.resource_version
    core.delete_namespaced_pod("chat-a", NS)
    assert watched(core, created.metadata.resource_version, count=2) == [
        ("MODIFIED", "chat-a"), ("DELETED", "chat-a")]


def test_a_watch_from_a_resource_version_the_server_no_longer_keeps_gets_410_gone(
        emulated: EmulatedCluster, core: Any) -> None:
    start = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod("chat-a", {"app": "chat"}))
    emulated.expire_watch_history()
    [(kind, code)] = watched(core, start)
    assert (kind, code) == ("ERROR", "410")
    fresh = core.list_namespaced_pod(NS).metadata.resource_version  # list again, then watch
    core.create_namespaced_pod(NS, pod("chat-b", {"app": "chat"}))
    assert watched(core, fresh) == [("ADDED", "chat-b")]


def test_a_write_naming_an_old_resource_version_is_refused_as_a_conflict(core: Any) -> None:
    created = core.create_namespaced_pod(NS, pod("chat-a", {"app": "chat"}))
    core.patch_namespaced_pod("chat-a", NS, {"metadata": {"labels": {"role": "active"}}})
    status, body = refusal(core.patch_namespaced_pod, "chat-a", NS, {"metadata": {
        "resourceVersion": created.metadata.resource_version, "labels": {"role": "x"}}},
        _content_type="application/merge-patch+json")
    assert status == 409 and body["reason"] == "Conflict"
    assert body["message"] == (
        'Operation cannot be fulfilled on pods "chat-a": the object has been modified; '
        "please apply your changes to the latest version and try again")


# --- 422 Invalid ------------------------------------------------------------------------


def test_a_deployments_selector_cannot_change(apps: Any) -> None:
    apply(apps, deployment())
    changed = deployment(selector={"app.kubernetes.io/instance": "chat", "tier": "gpu"})
    status, body = refusal(apply, apps, changed)
    assert status == 422 and body["reason"] == "Invalid" and body["kind"] == "Status"
    assert body["message"].startswith('Deployment.apps "chat" is invalid: spec.selector: ')
    assert body["message"].endswith(": field is immutable")
    assert body["details"]["causes"][0]["field"] == "spec.selector"


def test_a_service_name_must_be_a_dns_1035_label(emulated: EmulatedCluster,
                                                 tmp_path: Path) -> None:
    from kubernetes import client

    api = client.CoreV1Api(controller_client(emulated, tmp_path))
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "8b-chat"},
            "spec": {"ports": [{"port": 8000}]}}
    status, answer = refusal(api.patch_namespaced_service, "8b-chat", NS, body,
                             field_manager="fleetplane", force=True,
                             _content_type="application/apply-patch+yaml")
    assert status == 422
    assert answer["message"].startswith(
        'Service "8b-chat" is invalid: metadata.name: Invalid value: "8b-chat": a DNS-1035 '
        "label must consist of lower case alphanumeric characters or '-', start with an "
        "alphabetic character, and end with an alphanumeric character")


@pytest.mark.parametrize(("name", "labels", "field", "detail"), [
    ("Chat", SELECTOR, "metadata.name", "a lowercase RFC 1123 subdomain"),
    ("c" * 254, SELECTOR, "metadata.name", "must be no more than 253 characters"),
    ("chat", {"model": "m" * 64}, "spec.selector.matchLabels",
     "must be no more than 63 characters"),
    ("chat", {"model": "llama-"}, "spec.template.metadata.labels", "a valid label must"),
])
def test_deployment_names_and_label_values_are_validated(
        apps: Any, name: str, labels: dict[str, str], field: str, detail: str) -> None:
    status, body = refusal(apply, apps, deployment(name, selector=labels))
    assert status == 422
    assert body["message"].startswith(f'Deployment.apps "{name}" is invalid: ')
    assert any(c["field"] == field and detail in c["message"]
               for c in body["details"]["causes"])


def test_a_deployment_named_like_8b_chat_is_a_valid_subdomain(apps: Any) -> None:
    assert apply(apps, deployment("8b-chat")).metadata.name == "8b-chat"


# --- server-side apply: ownership of spec.replicas --------------------------------------


def test_an_apply_that_changes_replicas_someone_else_set_conflicts_unless_forced(
        emulated: EmulatedCluster, apps: Any) -> None:
    player = ClusterPlayer(emulated.url)
    apply(apps, deployment(replicas=2))
    assert replicas_owners(emulated) == ["fleetplane"]
    player.kubectl_scale("chat", 5)
    assert replicas_owners(emulated) == ["kubectl"]
    status, body = refusal(apply, apps, deployment(replicas=3), force=False)
    assert status == 409 and body["reason"] == "Conflict"
    assert body["message"] == ('Apply failed with 1 conflict: conflict with "kubectl" using '
                               "apps/v1: .spec.replicas")
    apply(apps, deployment(replicas=5), force=False)  # the same value: shared, no conflict
    assert replicas_owners(emulated) == ["fleetplane", "kubectl"]
    player.kubectl_patch("chat", {"spec": {"replicas": 6}}, manager="kubectl-edit")
    forced = apply(apps, deployment(replicas=3))
    assert forced.spec.replicas == 3 and replicas_owners(emulated) == ["fleetplane"]


def test_managed_fields_tell_who_sets_replicas_when_an_autoscaler_takes_over(
        emulated: EmulatedCluster, apps: Any) -> None:
    player = ClusterPlayer(emulated.url)
    apply(apps, deployment(replicas=3))
    # Applied without replicas, owned by nobody else: reset to the default, as Kubernetes
    # does (why a switch to an HPA briefly drops to one pod unless ownership moves first).
    released = apply(apps, deployment(replicas=None))
    assert released.spec.replicas == 1 and replicas_owners(emulated) == []
    player.hpa_scale("chat", 4)
    read: Any = player.apps.read_namespaced_deployment("chat", NS)
    [entry] = [e for e in read.metadata.managed_fields
               if e.manager == "horizontal-pod-autoscaler"]
    assert (entry.operation, entry.subresource) == ("Update", "scale")
    assert entry.fields_v1 == {"f:spec": {"f:replicas": {}}}
    kept = apply(apps, deployment(replicas=None), force=False)  # the backend's next pass
    assert kept.spec.replicas == 4 and replicas_owners(emulated) == ["horizontal-pod-autoscaler"]


def test_a_field_the_applier_no_longer_applies_is_removed(apps: Any) -> None:
    labelled = deployment()
    labelled["metadata"]["annotations"] = {"fleetplane.io/applied-hash": "1",
                                           "fleetplane.io/old": "x"}
    apply(apps, labelled)
    del labelled["metadata"]["annotations"]["fleetplane.io/old"]
    assert apply(apps, labelled).metadata.annotations == {"fleetplane.io/applied-hash": "1"}


# --- authorization ----------------------------------------------------------------------


def test_the_controllers_credentials_are_authorized_against_the_roles_in_deploy(
        emulated: EmulatedCluster, tmp_path: Path) -> None:
    from kubernetes import client

    api = client.CoreV1Api(controller_client(emulated, tmp_path))
    assert api.list_namespaced_pod(NS).items == []  # granted: list pods in `inference`
    status, body = refusal(api.create_namespaced_pod, NS, pod("chat-a", SELECTOR))
    assert status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == (
        f'pods is forbidden: User "{CONTROLLER}" cannot create resource "pods" in API group '
        '"" in the namespace "inference"')
    status, body = refusal(api.read_namespaced_secret, "fleetplane", "fleetplane")
    assert status == 403 and body["message"] == (
        f'secrets "fleetplane" is forbidden: User "{CONTROLLER}" cannot get resource '
        '"secrets" in API group "" in the namespace "fleetplane"')
    emulated.use_rbac(None)  # a test may turn authorization off
    created: Any = api.create_namespaced_pod(NS, pod("chat-a", SELECTOR))
    assert created.metadata.name == "chat-a"


def test_an_unknown_token_is_unauthorized(emulated: EmulatedCluster) -> None:
    from kubernetes import client

    configuration = client.Configuration(host=emulated.url)
    configuration.api_key = {"authorization": "Bearer stolen"}
    api = client.CoreV1Api(client.ApiClient(configuration))
    status, body = refusal(api.list_namespaced_pod, NS)
    assert status == 401 and body["message"] == "Unauthorized"


def test_the_leader_election_may_touch_only_its_own_lease() -> None:
    from kubernetes import client

    cluster = EmulatedCluster(anonymous=CONTROLLER).start()  # token-less calls: the controller
    try:
        api = client.ApiClient(client.Configuration(host=cluster.url))
        election = LeaseElection(api, "fleetplane", "fleetplane-controller", "controller-a")
        assert election.attempt() and election.attempt()  # created, then renewed
        other = LeaseElection(api, "fleetplane", "someone-elses", "controller-a")
        status, body = refusal(other.attempt)
        assert status == 403 and body["message"] == (
            f'leases.coordination.k8s.io "someone-elses" is forbidden: User "{CONTROLLER}" '
            'cannot get resource "leases" in API group "coordination.k8s.io" in the '
            'namespace "fleetplane"')
    finally:
        cluster.stop()
