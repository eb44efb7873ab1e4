from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane import services
from controlplane.models import Deployment
from models_registry.demo import DEMO_MODEL_NAME
from models_registry.models import Model

DEMO_DEPLOYMENT = "smollm2"


class Command(BaseCommand):
    help = "Create the demo deployment (the demo model, local backend, 1 replica), once."

    def handle(self, *args: Any, **options: Any) -> None:
        existing = Deployment.objects.filter(name=DEMO_DEPLOYMENT).first()
        if existing is not None:
            self.stdout.write(f"Demo deployment {DEMO_DEPLOYMENT} exists "
                              f"({existing.state}, {existing.replicas} replica(s))")
            return
        model = Model.objects.filter(name=DEMO_MODEL_NAME).first()
        if model is None or not model.is_ready():
            raise CommandError("the demo model is not imported: run manage.py "
                               "import_demo_model first")
        deployment = services.create_deployment(services.DeploymentSpec(
            name=DEMO_DEPLOYMENT, model=model, backend=services.default_local_backend(),
            # Eager mode: ready in well under a minute instead of about 90 s on a 2-core
            # CPU machine, and vLLM's CPU build answers the demo model's greedy prompts
            # correctly in it, where its compiled bf16 graphs were seen to drift.
            engine_args={"max_model_len": 2048, "served_model_name": DEMO_DEPLOYMENT,
                         "extra_args": ["--enforce-eager"]},
            replicas=1, min_replicas=0, max_replicas=4), actor="make run")
        self.stdout.write(f"Created the demo deployment {deployment.name}: its replica "
                          f"starts with the server and is ready in a minute or two")
