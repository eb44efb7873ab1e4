from __future__ import annotations

from django.apps import AppConfig


class ControlplaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Control plane"
    default_auto_field = "django.db.models.BigAutoField"
