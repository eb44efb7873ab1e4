from __future__ import annotations

from django.apps import AppConfig


class ModelsRegistryConfig(AppConfig):
    name = "models_registry"
    verbose_name = "Model registry"
    default_auto_field = "django.db.models.BigAutoField"
