from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from models_registry import services
from models_registry.demo import (
    DEMO_DISPLAY_NAME,
    DEMO_MODEL_NAME,
    DemoModelMissingError,
    demo_gguf_path,
)
from models_registry.importers import ModelSourceError
from models_registry.models import Model


class Command(BaseCommand):
    help = "Import the demo model (SmolLM2-135M-Instruct GGUF) into the registry, once."

    def handle(self, *args: Any, **options: Any) -> None:
        existing = Model.objects.filter(name=DEMO_MODEL_NAME).first()
        if existing is not None and existing.is_ready() and Path(existing.path).is_dir():
            self.stdout.write(f"Demo model {DEMO_MODEL_NAME} is ready in {existing.path}")
            return
        if existing is not None:
            self.stdout.write(f"Demo model {DEMO_MODEL_NAME} was {existing.status}; "
                              f"importing it again")
            existing.delete()
        try:
            gguf = demo_gguf_path()
        except DemoModelMissingError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Importing the demo model from {gguf}")
        try:
            model = services.register_model(
                services.ModelSpec(name=DEMO_MODEL_NAME, source=Model.Source.GGUF,
                                   uri=str(gguf), display_name=DEMO_DISPLAY_NAME),
                import_in_background=False, trusted_path=True,
            )
        except ModelSourceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        if not model.is_ready():
            raise CommandError(f"demo model import failed: {model.error}")
        self.stdout.write(f"Demo model {model.name} is ready in {model.path} "
                          f"({model.parameter_count:,} parameters)")
