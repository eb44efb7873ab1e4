"""Kubernetes backend reconcile cost: 500 deployments of 4 replicas against the STAND-IN
API server (kmock, tests/k8s_emulator.py; no real API server runs on these machines).

The first pass applies every deployment's objects (server-side apply: Deployment, headless
Service, PodDisruptionBudget); the tests' ClusterPlayer then plays the ReplicaSet
controller and the kubelets (2,000 pods, all ready), and the reconciler takes them in
(replica records, promotion by label). Then passes with nothing changed are timed, with
the pod watch and listing the pods instead, alternating, and the API server's request
log is checked for writes during them.

    .venv/bin/python bench/k8s_reconcile.py [--deployments 500] [--replicas 4] [--passes 5]

Prints objects applied per second, and on its last line the no-change resync time
(target: under 5 s for 500 deployments, with no write request).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WRITES = ("POST", "PUT", "PATCH", "DELETE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deployments", type=int, default=500)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--passes", type=int, default=5)
    options = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="k8s-bench-"))
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS"):
        os.environ.pop(name, None)  # the development run's defaults: SQLite
    os.environ.update({"DEBUG": "true", "DATA_DIR": str(data), "LOG_LEVEL": "WARNING",
                       "DJANGO_SETTINGS_MODULE": "controlplane.settings"})
    import django

    django.setup()
    from django.core.management import call_command

    from tests.k8s_emulator import ClusterPlayer, EmulatedCluster, write_kubeconfig

    call_command("migrate", "--noinput", verbosity=0)
    emulated = EmulatedCluster(forget_requests=True).start()
    try:
        kubeconfig = write_kubeconfig(data / "kubeconfig", emulated.url)
        measure(options, emulated, ClusterPlayer(emulated.url), kubeconfig)
    finally:
        from controlplane.backends.base import close_backends

        close_backends()
        emulated.stop()


def writes(emulated: object) -> int:
    methods = getattr(getattr(emulated, "emulator", None), "methods", {})
    return sum(methods.get(method, 0) for method in WRITES)


def measure(options: argparse.Namespace, emulated: object, player: object,
            kubeconfig: str) -> None:
    from controlplane.models import Backend, Deployment, Replica
    from controlplane.reconciler import Reconciler
    from models_registry.models import Model
    from tests.k8s_emulator import ClusterPlayer

    assert isinstance(player, ClusterPlayer)
    model = Model.objects.create(name="llama", source="huggingface",
                                 source_uri="meta-llama/Llama-3.1-8B-Instruct",
                                 status="registered")
    backend = Backend.objects.create(name="gpus", kind="kubernetes", config={
        "namespace": "inference", "kubeconfig": kubeconfig, "warm_up": False})
    Deployment.objects.bulk_create(
        Deployment(name=f"d{i:04d}", model=model, backend=backend, replicas=options.replicas)
        for i in range(options.deployments))
    reconciler = Reconciler()

    before = writes(emulated)
    first = reconciler.reconcile_all()
    if first.errors:
        raise SystemExit(f"the first pass failed: {first.errors[:3]}")
    applied = writes(emulated) - before
    print(f"first apply: {applied} objects for {options.deployments} deployments in "
          f"{first.seconds:.2f} s: {applied / first.seconds:.0f} objects/s")

    started = time.perf_counter()
    pods = player.sync(ready=True)
    print(f"the stand-in cluster made {len(pods)} pods ready in "
          f"{time.perf_counter() - started:.1f} s (played, not measured)")
    wanted = options.deployments * options.replicas
    started = time.perf_counter()
    while Replica.objects.filter(phase="ready", role="active").count() < wanted:
        result = reconciler.reconcile_all()
        if result.errors:
            raise SystemExit(f"a pass failed: {result.errors[:3]}")
        if time.perf_counter() - started > 600:
            raise SystemExit("the pods did not all become ready replicas")
    print(f"{wanted} pods taken in as ready replicas in {time.perf_counter() - started:.1f} s")

    from controlplane.backends.base import backend_for
    from controlplane.backends.kubernetes import KubernetesBackend

    chosen = backend_for(backend)
    assert isinstance(chosen, KubernetesBackend) and chosen.watcher is not None
    before = writes(emulated)
    timings: list[float] = []
    listed: list[float] = []
    # Passes with the pod watch and passes listing the 2,000 pods instead alternate
    # (watched, listed, watched, listed ...), so both see the same machine.
    for _ in range(options.passes):
        if chosen.watcher is None:  # the watch again: started, and synced before timing
            chosen.watch = True
            reconciler.reconcile_all()
            deadline = time.monotonic() + 300
            while not (chosen.watcher and chosen.watcher.synced):
                if time.monotonic() > deadline:
                    raise SystemExit("the pod watch did not sync again")
                time.sleep(0.05)
        timings.append(no_change_pass(reconciler))
        chosen.watch = False
        chosen.watcher.stop()
        chosen.watcher = None
        listed.append(no_change_pass(reconciler))
    during = writes(emulated) - before
    print("resync passes (s): " + ", ".join(f"{t:.2f}" for t in timings))
    print("passes listing the pods instead of watching them (s): "
          + ", ".join(f"{t:.2f}" for t in listed))
    print(f"write requests during the resyncs: {during}")
    if during:
        raise SystemExit("a resync with nothing changed wrote to the API server")
    print(f"no-change resync, {options.deployments} deployments x {options.replicas} "
          f"replicas: median {statistics.median(timings):.2f} s, 0 writes")


def no_change_pass(reconciler: Any) -> float:
    """One pass's seconds; a pass that changes anything ends the benchmark."""
    result = reconciler.reconcile_all()
    if result.changed or result.errors:
        raise SystemExit(f"a resync with nothing changed changed {result.changed} "
                         f"deployments ({result.errors[:3]})")
    return float(result.seconds)


if __name__ == "__main__":
    main()
