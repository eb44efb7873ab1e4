"""The audit log's upkeep: repeated events coalesced into one row, old rows pruned.

Coalescing, as Kubernetes does with its events: an event that is the same as one last seen
within EVENT_COALESCE_SECONDS adds one to that row's `count`, moves its `last_seen` to now
and keeps the latest wording of its message, instead of adding a row. Two events are the
same when they have the same deployment, replica, actor, action, before and after, and
the same message once every standalone number in it is set aside (`same_event_key`): a
crash loop's "restart 7 in 80 s" and "restart 8 in 160 s", or a probe's changing timings,
are one event, while names that carry digits (`chat-r3`, `llama-3`) stay apart. A change
someone made is never folded into another with a different before or after.

Each event costs one indexed UPDATE (by `key` and `last_seen`), and an INSERT when no row
matched. The count is raised with an F() expression, so two writers coalescing into the
same row both count; two writers that both find no row at the same instant each insert
one, and their counts still add up.

Retention: rows last seen more than AUDIT_RETENTION_DAYS ago are deleted in batches of
PRUNE_BATCH rows, at most PRUNE_BATCHES_PER_SWEEP batches a sweep, once every
AUDIT_PRUNE_INTERVAL_SECONDS by the controllers (only the leader runs them) and by
`manage.py prune_events`. SECURITY_ACTIONS are kept for AUDIT_SECURITY_RETENTION_DAYS
(never less than AUDIT_RETENTION_DAYS).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import close_old_connections, connection
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from controlplane.models import AuditEvent, Deployment
from controlplane.outages import DatabaseOutage

logger = logging.getLogger(__name__)

# Who may do what, and with which credentials: kept for AUDIT_SECURITY_RETENTION_DAYS.
# Every action written for a key, a user, a team or a backend (whose settings hold
# credentials and what the control plane may start).
SECURITY_ACTIONS = frozenset({
    "key-created", "key-revoked",
    "user-created", "user-changed", "user-role-changed",
    "team-created", "team-changed",
    "backend-created", "backend-changed",
})

PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_SWEEP = 100

# A number on its own (not part of a name such as `chat-r3` or `llama-3.1`).
_NUMBER = re.compile(r"(?<![\w.-])\d+(?:[.:,]\d+)*(?![\w-])")


def same_event_key(actor: str, action: str, deployment: Deployment | None, replica: str,
                   message: str, before: Any, after: Any) -> str:
    """What makes two events the same one: a digest of who, what, where, the before and
    after, and the message with its standalone numbers set aside."""
    parts = [actor, action, deployment.pk if deployment else None, replica,
             _NUMBER.sub("#", message), before, after]
    # Values are JSON-like already (they are stored in JSON fields); str() covers the rest.
    encoded = orjson.dumps(parts, default=str,
                           option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(encoded).hexdigest()


def record_event(actor: str, action: str, deployment: Deployment | None, replica: str,
                 message: str, before: Any, after: Any) -> None:
    """Add the event, or count it on the same one seen within EVENT_COALESCE_SECONDS.
    The values come already redacted."""
    now = timezone.now()
    key = same_event_key(actor, action, deployment, replica, message, before, after)
    window = settings.EVENT_COALESCE_SECONDS
    if window > 0:
        recent = AuditEvent.objects.filter(
            key=key, last_seen__gte=now - timedelta(seconds=window)).order_by("-last_seen")
        counted = AuditEvent.objects.filter(pk__in=recent.values("pk")[:1]).update(
            count=F("count") + 1, last_seen=now, message=message)
        if counted:
            return
    AuditEvent.objects.create(actor=actor, action=action, deployment=deployment,
                              replica_name=replica, message=message, before=before,
                              after=after, at=now, last_seen=now, key=key)


@dataclass(frozen=True)
class Cutoffs:
    """Rows last seen before `ordinary` (or `security`, for SECURITY_ACTIONS) go."""

    ordinary: datetime
    security: datetime

    @classmethod
    def from_settings(cls, now: datetime | None = None) -> Cutoffs:
        now = now or timezone.now()
        days = settings.AUDIT_RETENTION_DAYS
        security_days = max(settings.AUDIT_SECURITY_RETENTION_DAYS, days)
        return cls(now - timedelta(days=days), now - timedelta(days=security_days))


def expired(cutoffs: Cutoffs) -> QuerySet[AuditEvent]:
    """The rows past their retention."""
    security = Q(action__in=SECURITY_ACTIONS)
    return AuditEvent.objects.filter(
        (~security & Q(last_seen__lt=cutoffs.ordinary))
        | (security & Q(last_seen__lt=cutoffs.security)))


def prune_events(cutoffs: Cutoffs | None = None, *,
                 batches: int = PRUNE_BATCHES_PER_SWEEP) -> int:
    """Delete up to `batches` batches of expired rows, oldest first; the number deleted.
    Each batch is its own statement, so no lock is held on the table for long."""
    cutoffs = cutoffs or Cutoffs.from_settings()
    deleted = 0
    for _ in range(batches):
        ids = list(expired(cutoffs).order_by("last_seen", "id")
                   .values_list("pk", flat=True)[:PRUNE_BATCH])
        if not ids:
            break
        deleted += AuditEvent.objects.filter(pk__in=ids).delete()[0]
        if len(ids) < PRUNE_BATCH:
            break
    return deleted


def _sweep() -> int:
    close_old_connections()
    try:
        return prune_events()
    finally:
        # Once an hour: the worker thread need not keep a connection open till the next.
        connection.close()


async def run_event_pruning(stop: asyncio.Event) -> None:
    """A retention sweep at start and then every AUDIT_PRUNE_INTERVAL_SECONDS, in a worker
    thread, until `stop` is set. A sweep that hit its batch limit is followed by the next
    one at once."""
    outage = DatabaseOutage("audit-log pruning", logger)
    batch_limit = PRUNE_BATCH * PRUNE_BATCHES_PER_SWEEP
    while not stop.is_set():
        deleted = 0
        try:
            deleted = await asyncio.to_thread(_sweep)
            outage.succeeded()
        except Exception as error:
            outage.failed(error)
        if deleted:
            logger.info("audit log: %d events past their retention deleted", deleted)
        if deleted >= batch_limit:
            continue
        try:
            await asyncio.wait_for(stop.wait(), timeout=settings.AUDIT_PRUNE_INTERVAL_SECONDS)
        except TimeoutError:
            pass
