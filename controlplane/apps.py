from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class ControlplaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from access.signals import changed

        changed.connect(write_audit_event, dispatch_uid="controlplane.audit")
        from controlplane import revocation

        revocation.connect()


def write_audit_event(sender: Any, *, actor: str, action: str, message: str,
                      before: Any = None, after: Any = None, **kwargs: Any) -> None:
    """The audit log's entry for a change another app made (access/signals.py)."""
    from controlplane.services import audit

    audit(actor, action, None, message, before=before, after=after)
