"""`changed`: something an admin should find in the audit log happened (a key, team, user
or model was created, changed or removed). Sent by the app that made the change;
controlplane/ (which keeps the audit log) writes the event. Keyword arguments: actor,
action, message, before, after."""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

changed = Signal()


def record(actor: str, action: str, message: str, before: Any = None,
           after: Any = None) -> None:
    changed.send(sender=None, actor=actor, action=action, message=message, before=before,
                 after=after)
