"""Reconcile cost: one pass over N deployments on the external backend with nothing to
change. Target: 1,000 deployments in under 1 s.

The endpoints are one local stand-in OpenAI-compatible server (it answers /v1/models).
Runs on its own SQLite database in a temporary folder.

    .venv/bin/python bench/reconcile_cost.py [--deployments 1000] [--passes 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deployments", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=5)
    options = parser.parse_args()

    data = tempfile.mkdtemp(prefix="reconcile-bench-")
    # Health probes are paced (HEALTH_CHECK_SECONDS) apart from passes; this measures the
    # passes between probes, so the pace is set longer than the measurement.
    os.environ.update({"DATA_DIR": data, "DJANGO_SETTINGS_MODULE": "controlplane.settings",
                       "DEBUG": "true",
                       "LOG_LEVEL": "WARNING", "HEALTH_CHECK_SECONDS": "120"})
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    from tests.endpoints import stand_in_endpoint

    call_command("migrate", verbosity=0)
    with stand_in_endpoint() as endpoint:
        measure(options.deployments, options.passes, endpoint.url)


def measure(deployments: int, passes: int, url: str) -> None:
    from controlplane.models import Backend, Deployment, Replica
    from controlplane.reconciler import Reconciler
    from models_registry.models import Model

    model = Model.objects.create(name="remote", source="huggingface", source_uri="o/remote",
                                 status="registered")
    backend = Backend.objects.create(name="edge", kind="external", config={"url": url})
    Deployment.objects.bulk_create(
        Deployment(name=f"d{i:05d}", model=model, backend=backend, replicas=1)
        for i in range(deployments))

    reconciler = Reconciler()
    started = time.perf_counter()
    while Replica.objects.filter(phase="ready").count() < deployments:
        reconciler.reconcile_all()
        if time.perf_counter() - started > 600:
            raise SystemExit("replicas did not all become ready")
    print(f"converged {deployments} deployments in "
          f"{time.perf_counter() - started:.1f} s")

    timings = []
    for _ in range(passes):
        result = reconciler.reconcile_all()
        if result.changed:
            raise SystemExit(f"a pass with nothing to change changed {result.changed}")
        timings.append(result.seconds)
    print("passes (s): " + ", ".join(f"{t:.3f}" for t in timings))
    reconciler.last_probe.clear()
    probing = reconciler.reconcile_all()
    print(f"a pass that also probes every endpoint over HTTP: {probing.seconds:.2f} s")
    print(f"reconcile pass, {deployments} external deployments, nothing to change: "
          f"median {statistics.median(timings) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
