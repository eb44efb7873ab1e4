"""Time to ready of one local CPU replica of the demo model: from process start to the
first warm-up completion returning, cold (empty vLLM compile cache) and warm (the cache the
cold start left).

    .venv/bin/python bench/replica_time_to_ready.py [--eager]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eager", action="store_true", help="pass --enforce-eager")
    options = parser.parse_args()

    data = Path(tempfile.mkdtemp(prefix="ttr-bench-"))
    os.environ.update({"DATA_DIR": str(data), "DJANGO_SETTINGS_MODULE": "controlplane.settings",
                       "DEBUG": "true",
                       "LOG_LEVEL": "WARNING", "VLLM_CACHE_ROOT": str(data / "vllm-cache"),
                       "RECONCILE_INTERVAL_SECONDS": "0.2", "HEALTH_CHECK_SECONDS": "0.5"})
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    from controlplane import services
    from controlplane.models import Deployment, Replica
    from controlplane.reconciler import Reconciler
    from models_registry.demo import demo_gguf_path
    from models_registry.importers import convert_gguf
    from models_registry.services import ModelSpec, register_model

    call_command("migrate", verbosity=0)
    folder = data / "models" / "demo"  # under DATA_DIR/models: an import root
    convert_gguf(demo_gguf_path(), folder, lambda percent, stage: None)
    model = register_model(ModelSpec(name="smollm2", source="local", uri=str(folder)))
    engine_args: dict[str, object] = {"max_model_len": 2048}
    if options.eager:
        engine_args["extra_args"] = ["--enforce-eager"]
    deployment = services.create_deployment(services.DeploymentSpec(
        name="bench", model=model, backend=services.default_local_backend(),
        engine_args=engine_args, replicas=1), actor="bench")
    reconciler = Reconciler()

    def wait_ready(name: str) -> float:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            reconciler.reconcile_all()
            replica = Replica.objects.filter(name=name, phase="ready").first()
            if replica is not None:
                took = replica.time_to_ready()
                assert took is not None
                return took.total_seconds()
            time.sleep(0.2)
        raise SystemExit("the replica did not become ready in 900 s")

    def scale_to_zero() -> None:
        services.scale_deployment(Deployment.objects.get(pk=deployment.pk), 0, actor="bench")
        deadline = time.monotonic() + 120
        while Replica.objects.filter(deployment=deployment).exists() and \
                time.monotonic() < deadline:
            reconciler.reconcile_all()
            time.sleep(0.2)

    # Each start runs alone on the machine: the first replica is stopped before the second.
    cold = wait_ready("bench-1")
    print(f"cold start (empty compile cache): {cold:.1f} s")
    scale_to_zero()
    services.scale_deployment(Deployment.objects.get(pk=deployment.pk), 1, actor="bench")
    warm = wait_ready("bench-2")
    print(f"warm start (the compile cache of the first start on disk): {warm:.1f} s")
    scale_to_zero()
    mode = "eager" if options.eager else "compiled"
    print(f"time to ready of one local CPU replica ({mode}): cold {cold:.1f} s, "
          f"warm {warm:.1f} s")


if __name__ == "__main__":
    main()
