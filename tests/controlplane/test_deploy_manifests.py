"""deploy/: the control plane's own manifests validate against the real Kubernetes OpenAPI
schemas (1.36 and 1.37, strict), and the RBAC rules grant exactly what the code uses: every
request the Kubernetes backend and the leader election send to the STAND-IN API server
(tests/k8s_emulator.py, which authorizes them against these Roles) through a whole life of
deployments, taken as Kubernetes' authorizer takes it, is granted, and every rule is used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controlplane.backends.kubernetes import KubernetesBackend
from controlplane.leader import LeaseElection
from controlplane.models import AuditEvent, Deployment, Replica
from controlplane.reconciler import Reconciler
from tests.factories import make_backend, make_deployment, make_model
from tests.k8s_emulator import ClusterPlayer, EmulatedCluster, write_kubeconfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VERSIONS = ("1.36.0", "1.37.0")


def documents(name: str) -> list[dict[str, Any]]:
    with (DEPLOY / name).open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def manifests() -> list[str]:
    return sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("name", manifests())
def test_every_manifest_validates(name: str) -> None:
    docs = documents(name)
    assert docs
    for version in VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_kustomization_names_files_that_exist() -> None:
    [kustomization] = documents("kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource
    assert "secret.example.yaml" not in kustomization["resources"]  # never real secrets
    assert "rbac-keda.yaml" not in kustomization["resources"]  # only where KEDA is used
    assert "rbac-monitoring.yaml" not in kustomization["resources"]  # only with PodMonitors


def test_the_inference_namespace_enforces_pod_security() -> None:
    [inference] = [d for d in documents("namespaces.yaml")
                   if d["metadata"]["name"] == "inference"]
    labels = inference["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


Need = tuple[str, str, str, str, str]  # namespace, API group, resource[/sub], verb, name
Grant = tuple[str, str, str, str, frozenset[str]]  # ... and resourceNames (empty: any)
SERVICE_ACCOUNT = {"kind": "ServiceAccount", "name": "fleetplane-controller",
                   "namespace": "fleetplane"}


def grants(*names: str) -> set[Grant]:
    """Every (namespace, group, resource, verb, resourceNames) the Roles in these files
    grant to the controller's service account through their RoleBindings."""
    docs = [doc for name in names for doc in documents(name)]
    bound = {(d["metadata"]["namespace"], d["roleRef"]["name"]) for d in docs
             if d["kind"] == "RoleBinding" and SERVICE_ACCOUNT in d["subjects"]}
    return {(role["metadata"]["namespace"], group, resource, verb,
             frozenset(rule.get("resourceNames") or ()))
            for role in docs if role["kind"] == "Role"
            and (role["metadata"]["namespace"], role["metadata"]["name"]) in bound
            for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def needs(request: Any) -> set[Need]:
    """What Kubernetes' RBAC authorizer checks for one request: the verb from the method
    (a GET by name `get`, of a collection `list`, with ?watch `watch`), and for a
    server-side apply, which creates the object when it is missing, `create` as well."""
    method = str(getattr(request.method, "name", request.method)).upper()
    if method == "GET":
        verb = ("watch" if request.params.get("watch") in ("true", "1")
                else "get" if request.name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if request.name else "deletecollection"}[method]
    resource = request.resource.plural + (
        f"/{request.subresource}" if request.subresource else "")
    # A POST names its object in the body: the authorizer sees no name for a create.
    name = request.name or ""
    found = {(request.namespace or "", request.resource.group or "", resource, verb, name)}
    content_type = {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
    if verb == "patch" and content_type.startswith("application/apply-patch"):
        found.add((request.namespace or "", request.resource.group or "", resource,
                   "create", name))
    return found


def covers(grant: Grant, need: Need) -> bool:
    return grant[:4] == need[:4] and (not grant[4] or need[4] in grant[4])


def controller_api(kubeconfig: str) -> Any:
    """An ApiClient with the controller's credentials (the kubeconfig's token)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


def a_whole_life(emulated: EmulatedCluster, tmp_path: Path) -> None:
    """Deployments through every kind of scaling: created, pods taken in, a warm standby
    chosen, scaled down, a log read, removed; then the leader election's Lease."""
    player = ClusterPlayer(emulated.url)
    model = make_model("llama")
    backends = {}
    for scaling in ("controlplane", "hpa", "keda"):
        backends[scaling] = make_backend(f"gpus-{scaling}", "kubernetes", {
            "namespace": "inference", "model_source": "pvc", "pvc_name": "models",
            "warm_up": False, "scaling": scaling, "pod_monitor": scaling == "keda",
            "kubeconfig": write_kubeconfig(tmp_path / scaling, emulated.url)})
    chat = make_deployment("chat", model=model, backend=backends["controlplane"],
                           replicas=2, standby=1)
    make_deployment("native", model=model, backend=backends["hpa"], replicas=1)
    make_deployment("events", model=model, backend=backends["keda"], replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
    reconciler.reconcile_all()  # applied, no pods yet: why not is read (sets, events)
    player.sync(ready=True)
    for _ in range(50):  # warm standby chosen (a label), pods taken in
        reconciler.reconcile_all()
        if Replica.objects.filter(deployment=chat, role="standby").exists():
            break
    assert Replica.objects.filter(deployment=chat, role="standby").exists()
    Deployment.objects.filter(pk=chat.pk).update(replicas=1)
    reconciler.reconcile_all()  # a scale-down marks its victim (pod-deletion cost)
    from controlplane.backends.base import backend_for

    backend = backend_for(backends["controlplane"])
    assert isinstance(backend, KubernetesBackend)
    backend.logs(Replica.objects.filter(deployment=chat).first(), 20)  # type: ignore[arg-type]
    Deployment.objects.update(deleting=True)
    reconciler.reconcile_all()  # removal of everything owned
    election = LeaseElection(controller_api(str(tmp_path / "controlplane")), "fleetplane",
                             "fleetplane-controller", "controller-a")
    assert election.attempt() and election.attempt()  # created, then renewed


@pytest.mark.django_db
def test_rbac_grants_exactly_what_the_code_uses(emulated: EmulatedCluster, tmp_path: Path,
                                                settings: Any) -> None:
    settings.RESTART_BACKOFF_BASE_SECONDS = 0.1
    a_whole_life(emulated, tmp_path)
    server = emulated.server()
    sent = emulated.call(lambda: [r for r in server if r.resource is not None and {
        k.lower(): v for k, v in r.headers.items()}.get("authorization") == "Bearer test-token"])
    needed = set().union(*(needs(request) for request in sent))
    granted = grants("rbac.yaml", "rbac-keda.yaml", "rbac-monitoring.yaml")
    assert {n for n in needed if not any(covers(g, n) for g in granted)} == set()
    assert {g for g in granted if not any(covers(g, n) for n in needed)} == set()
    # The stand-in refused nothing along the way (it authorizes against the same files).
    assert not [a for a in server.authorizations if not server.rbac or not server.rbac.allows(a)]
    # KEDA's kind only in its own file, applied only where KEDA is used.
    assert {g[1] for g in grants("rbac-keda.yaml")} == {"keda.sh"}
    assert "keda.sh" not in {g[1] for g in grants("rbac.yaml")}
    # The Prometheus Operator's likewise.
    assert {g[1] for g in grants("rbac-monitoring.yaml")} == {"monitoring.coreos.com"}
    assert "monitoring.coreos.com" not in {g[1] for g in grants("rbac.yaml")}
    assert emulated.stored("monitoring.coreos.com/v1/podmonitors", "inference",
                           "events") is None  # made, then removed with its deployment


# The Role as it was before server-side apply's `create` was granted.
OLD_BACKEND_ROLE = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: fleetplane-backend, namespace: inference}
rules:
  - {apiGroups: [apps], resources: [deployments], verbs: [list, patch, delete]}
  - {apiGroups: [""], resources: [services, secrets], verbs: [list, patch, delete]}
  - {apiGroups: [policy], resources: [poddisruptionbudgets], verbs: [list, patch, delete]}
  - {apiGroups: [autoscaling], resources: [horizontalpodautoscalers], verbs: [list, patch, delete]}
  - {apiGroups: [networking.k8s.io], resources: [networkpolicies], verbs: [list, patch, delete]}
  - {apiGroups: [""], resources: [pods/log], verbs: [get]}
  - {apiGroups: [""], resources: [pods], verbs: [list, watch, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: fleetplane-backend, namespace: inference}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: fleetplane-backend}
subjects: [{kind: ServiceAccount, name: fleetplane-controller, namespace: fleetplane}]
"""


@pytest.mark.django_db
def test_without_create_the_first_apply_is_forbidden_and_the_deployment_says_so(
        emulated: EmulatedCluster, tmp_path: Path) -> None:
    emulated.use_rbac(yaml.safe_load_all(OLD_BACKEND_ROLE))
    deployment = make_deployment("chat", model=make_model("llama"), backend=make_backend(
        "gpus", "kubernetes", {"namespace": "inference", "model_source": "pvc",
                               "pvc_name": "models", "warm_up": False,
                               "kubeconfig": write_kubeconfig(tmp_path / "k", emulated.url)}))
    Reconciler().reconcile_all()
    refused = ('HTTP 403: applying Secret chat-engine-key: secrets "chat-engine-key" is '
               'forbidden: User "system:serviceaccount:fleetplane:fleetplane-controller" '
               'cannot create resource "secrets" in API group "" in the namespace "inference"')
    deployment.refresh_from_db()
    degraded = deployment.condition("Degraded")
    assert degraded is not None and degraded["status"] == "True"
    assert refused in degraded["message"]
    [failed] = AuditEvent.objects.filter(deployment=deployment, action="apply-failed")
    assert failed.message.startswith(refused)
    assert emulated.stored("v1/secrets", "inference", "chat-engine-key") is None
    assert emulated.stored("apps/v1/deployments", "inference", "chat") is None
