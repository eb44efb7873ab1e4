"""Helpers shared by the Kubernetes backend's tests against the STAND-IN API server (kmock,
tests/k8s_emulator.py): a deployment factory on a kubernetes backend, reconcile-until,
and the stand-in's /version answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from controlplane.backends.base import backend_for
from controlplane.backends.kubernetes import KubernetesBackend
from controlplane.models import Deployment, Replica
from controlplane.reconciler import Reconciler
from tests.factories import make_backend, make_deployment, make_model
from tests.k8s_emulator import EmulatedCluster, write_kubeconfig


def serve_version(emulated: EmulatedCluster, minor: str = "36") -> None:
    """Make the stand-in answer GET /version/ as a Kubernetes 1.<minor> server does."""
    def serve() -> None:
        assert emulated.emulator is not None
        emulated.emulator.server_version = {
            "major": "1", "minor": minor, "gitVersion": f"v1.{minor}.0",
            "platform": "linux/amd64"}

    emulated.call(serve)


def deployment_factory(emulated: EmulatedCluster, tmp_path: Any, settings: Any,
                       minor: str = "36", **config: Any) -> Callable[..., Deployment]:
    settings.RESTART_BACKOFF_BASE_SECONDS = 0.2
    settings.RESTART_BACKOFF_MAX_SECONDS = 0.4
    serve_version(emulated, minor)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emulated.url)
    record = make_backend("gpus", "kubernetes", {
        "namespace": "inference", "kubeconfig": kubeconfig, "model_source": "pvc",
        "pvc_name": "models", "warm_up": False, **config})
    model = make_model("llama")

    def create(name: str = "chat", **fields: Any) -> Deployment:
        return cast(Deployment, make_deployment(name, model=model, backend=record, **fields))

    return create


def backend_of(deployment: Deployment) -> KubernetesBackend:
    return cast(KubernetesBackend, backend_for(deployment.backend))


def converge(reconciler: Reconciler, check: Callable[[], Any], what: str,
             seconds: float = 10) -> Any:
    """Reconcile until `check` holds (the watch delivers the played changes meanwhile)."""
    deadline = time.monotonic() + seconds
    while True:
        result = reconciler.reconcile_all()
        assert not result.errors, result.errors
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


def rows(deployment: Deployment) -> list[Replica]:
    return list(Replica.objects.filter(deployment=deployment).order_by("name"))


def phases(deployment: Deployment) -> dict[str, tuple[str, str]]:
    return {r.name: (r.phase, r.role) for r in rows(deployment)}
