from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.backends.base import BackendConfigError
from controlplane.backends.k8s_manifests import SCALING, KubernetesConfig, render, to_yaml
from controlplane.models import Deployment


class Command(BaseCommand):
    help = ("Print the Kubernetes manifests (YAML) the kubernetes backend applies for a "
            "deployment: for review, GitOps, or `kubectl apply --dry-run=server -f -`.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("deployment")
        parser.add_argument("--config", default="",
                            help="a kubernetes backend configuration as JSON, for a "
                                 "deployment whose own backend is not kubernetes, e.g. "
                                 "'{\"namespace\": \"inference\", \"gpu_product\": "
                                 "\"NVIDIA-H100-80GB-HBM3\"}'")
        parser.add_argument("--scaling", choices=SCALING, default="",
                            help="add a HorizontalPodAutoscaler (hpa) or a KEDA "
                                 "ScaledObject (keda); default: the configuration's "
                                 "`scaling` (the control plane scales)")

    def handle(self, *args: Any, **options: Any) -> None:
        deployment = Deployment.objects.select_related("model", "backend").filter(
            name=options["deployment"]).first()
        if deployment is None:
            raise CommandError(f"no deployment named {options['deployment']!r}")
        if options["config"]:
            try:
                raw = json.loads(options["config"])
            except ValueError as exc:
                raise CommandError(f"--config is not JSON: {exc}") from None
            if not isinstance(raw, dict):
                raise CommandError("--config must be a JSON object")
        elif deployment.backend.kind == "kubernetes":
            raw = dict(deployment.backend.config)
        else:
            raise CommandError(f"{deployment.name} runs on the {deployment.backend.kind} "
                               f"backend: give a kubernetes configuration with --config")
        try:
            config = KubernetesConfig.from_dict(raw)
            objects = render(deployment, config, options["scaling"])
        except BackendConfigError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        self.stdout.write(to_yaml(objects), ending="")
