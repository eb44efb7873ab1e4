from __future__ import annotations

from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from serving import schema  # noqa: F401  (registers the OpenAPI extension)
