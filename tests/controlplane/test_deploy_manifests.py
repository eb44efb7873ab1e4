"""deploy/: the control plane's own manifests validate against the real Kubernetes OpenAPI
schemas (1.36 and 1.37, strict), and the RBAC rules grant exactly what the code uses:
every request the Kubernetes backend and the leader election send to the STAND-IN API
server (kmock) through a whole life of deployments is allowed, and every rule is used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controlplane.backends.kubernetes import KubernetesBackend
from controlplane.leader import LeaseElection
from controlplane.models import Deployment, Replica
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


def test_the_inference_namespace_enforces_pod_security() -> None:
    [inference] = [d for d in documents("namespaces.yaml")
                   if d["metadata"]["name"] == "inference"]
    labels = inference["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


def granted(name: str, role: str) -> set[tuple[str, str, str]]:
    [found] = [d for d in documents(name) if d["kind"] == "Role"
               and d["metadata"]["name"] == role]
    return {(group, resource, verb) for rule in found["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


@pytest.mark.django_db
def test_rbac_grants_exactly_what_the_code_uses(emulated: EmulatedCluster, tmp_path: Path,
                                                settings: Any) -> None:
    settings.RESTART_BACKOFF_BASE_SECONDS = 0.1
    player = ClusterPlayer(emulated.url)
    model = make_model("llama")
    backends = {}
    for scaling in ("controlplane", "hpa", "keda"):
        backends[scaling] = make_backend(f"gpus-{scaling}", "kubernetes", {
            "namespace": "inference", "model_source": "pvc", "pvc_name": "models",
            "warm_up": False, "scaling": scaling,
            "kubeconfig": write_kubeconfig(tmp_path / scaling, emulated.url)})
    chat = make_deployment("chat", model=model, backend=backends["controlplane"],
                           replicas=2, standby=1)
    make_deployment("native", model=model, backend=backends["hpa"], replicas=1)
    make_deployment("events", model=model, backend=backends["keda"], replicas=1)
    reconciler = Reconciler()
    reconciler.reconcile_all()
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
    election = LeaseElection(player.api.__class__(player.api.configuration), "fleetplane",
                             "fleetplane-controller", "controller-a")
    assert election.attempt() and election.attempt()  # created, then renewed

    assert emulated.emulator is not None
    used = emulated.emulator.verbs
    backend_used = {u for u in used if u[1] != "leases"}
    keda = {u for u in backend_used if u[0] == "keda.sh"}
    assert backend_used - keda == granted("rbac.yaml", "fleetplane-backend")
    assert keda == granted("rbac-keda.yaml", "fleetplane-backend-keda")
    assert {u for u in used if u[1] == "leases"} == granted(
        "rbac.yaml", "fleetplane-leader-election")
