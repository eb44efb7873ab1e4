"""What both reconcilers write, and how: replica fields, events, the deployment's
conditions (Available, Progressing, Degraded) and the backoff after a failure."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.models import Deployment, Replica
from controlplane.services import audit

ACTOR = "reconciler"
LOG_LINES_IN_ERRORS = 15


def restart_backoff(restarts: int) -> timedelta:
    """5 s, 10 s, 20 s ... capped at RESTART_BACKOFF_MAX_SECONDS."""
    base = settings.RESTART_BACKOFF_BASE_SECONDS
    delay = min(base * 2 ** max(restarts - 1, 0), settings.RESTART_BACKOFF_MAX_SECONDS)
    return timedelta(seconds=delay)


def event(deployment: Deployment | None, action: str, message: str, *,
          replica: Replica | None = None) -> None:
    """Record what the reconciler did or saw, as the reconciler."""
    audit(ACTOR, action, deployment, message, replica=replica.name if replica else "")


def save(replica: Replica, **fields: Any) -> bool:
    """Set these fields and write only them; True (a change was made)."""
    for name, value in fields.items():
        setattr(replica, name, value)
    replica.save(update_fields=list(fields))
    return True


def write_status(deployment: Deployment, replicas: list[Replica],
                 problems: list[str] | None = None) -> bool:
    """Write the deployment's conditions and observed generation when they changed;
    True when something was written."""
    wanted = deployment.desired_replicas()
    ready = [r for r in replicas
             if r.phase == Replica.Phase.READY and r.role == Replica.Role.ACTIVE]
    failed = [r for r in replicas if r.phase == Replica.Phase.FAILED]
    problems = [*(problems or []), *(f"{r.name}: {r.last_error}" for r in failed)]
    outdated = [r for r in replicas if r.generation != deployment.generation]
    pending = [r for r in replicas if r.phase != Replica.Phase.READY]
    conditions = [
        condition("Available", wanted > 0 and len(ready) >= wanted,
                  f"{len(ready)} of {wanted} replicas ready" if wanted else
                  "stopped" if deployment.state == Deployment.State.STOPPED else
                  "scaled to zero"),
        condition("Progressing", bool(outdated or pending),
                  f"{len(outdated)} outdated, {len(pending)} not ready"
                  if outdated or pending else "all replicas are up to date"),
        condition("Degraded", bool(problems),
                  "\n".join(problems)[-2000:] if problems else "no failed replicas"),
    ]
    merged = keep_transitions(conditions, deployment.conditions)
    observed = deployment.generation if not outdated and len(ready) >= wanted else \
        deployment.observed_generation
    if merged == deployment.conditions and observed == deployment.observed_generation:
        return False
    deployment.conditions = merged
    deployment.observed_generation = observed
    Deployment.objects.filter(pk=deployment.pk).update(conditions=merged,
                                                       observed_generation=observed)
    return True


def keep_transitions(conditions: list[dict[str, str]], previous: list[dict[str, str]]
                     ) -> list[dict[str, str]]:
    """A condition whose status did not change keeps the time of its last transition."""
    before = {c["type"]: c for c in previous}
    merged = []
    for item in conditions:
        old = before.get(item["type"])
        if old and old["status"] == item["status"]:
            item["last_transition"] = old.get("last_transition", item["last_transition"])
        merged.append(item)
    return merged


def condition(kind: str, status: bool, message: str) -> dict[str, str]:
    """One condition as the deployment stores it, as of now."""
    return {"type": kind, "status": "True" if status else "False", "message": message,
            "last_transition": timezone.now().isoformat()}
