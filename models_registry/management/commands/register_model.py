from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from models_registry import services
from models_registry.importers import ModelSourceError
from models_registry.models import Model


class Command(BaseCommand):
    help = ("Register a model: a local Hugging Face folder, a GGUF file (converted here, with "
            "a progress bar), a Hugging Face id, or the model folder an installed Python "
            "package carries (--source package --package NAME).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="a slug: lower-case letters, digits and hyphens")
        parser.add_argument("--source", required=True, choices=Model.Source.values)
        parser.add_argument("--path", default="", help="folder or GGUF file")
        parser.add_argument("--hf-id", default="", help="owner/name on the Hugging Face Hub")
        parser.add_argument("--package", default="",
                            help="an installed Python package that carries a model folder")
        parser.add_argument("--display-name", default="")
        parser.add_argument("--revision", default="")
        parser.add_argument("--license", default="")

    def handle(self, *args: Any, **options: Any) -> None:
        spec = services.ModelSpec(
            name=options["name"], source=options["source"],
            uri={"huggingface": options["hf_id"], "package": options["package"]}.get(
                options["source"], options["path"]),
            display_name=options["display_name"], revision=options["revision"],
            license=options["license"],
        )
        try:
            model = services.register_model(spec, import_in_background=False)
        except ModelSourceError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        if model.status == Model.Status.FAILED:
            raise CommandError(f"{model.name}: {model.error}")
        self.stdout.write(f"{model.name}: {model.status}, task {model.task}"
                          + (f" ({model.error})" if model.error else ""))
