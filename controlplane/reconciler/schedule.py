"""Which deployments a reconcile pass visits, so that an idle fleet costs next to nothing.

A full pass (every deployment, then the route table rebuilt) runs when something may have
changed: the first pass of a process, a pass asked for in this process
(`wakeups.request_reconcile`: services, the autoscaler), a change seen in the audit log
(`ChangeWatch`: every change made through the API, the pages, the CLI or the autoscaler
writes an event there, from whatever process), and at least every
RECONCILE_RESYNC_SECONDS as a safety net for a write nothing told (a SQL shell); on
SQLite that one only when the database file shows a commit by someone else since the
last full pass (such a write moves its counter too).

Between full passes a pass visits only the deployments with work to do: those not
settled (a replica on its way somewhere, a deployment being deleted, a backend whose
replicas are checked every pass: local processes, Kubernetes pods), and those with a
probe due (controlplane/reconciler/probes.py). A settled fleet of external endpoints thus
costs one indexed query a second and the probes that fall due; on SQLite not even the
query while the database file's commit counter says nobody else has committed since the
last one (`PassSchedule.quiet`, serving/sqlite_commits.py): such a pass is skipped.
"""

from __future__ import annotations

import time
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.models import AuditEvent, Deployment, Replica
from serving.sqlite_commits import commits, counter

# The reconciler's own events are its own doing; it needs no telling.
OWN_ACTOR = "reconciler"
# How far back the change watch looks: longer than any transaction that writes an event
# stays open, so one committed late (its `last_seen` older than events seen before it)
# is still seen.
CHANGE_WINDOW_SECONDS = 120


# Raised after each pass that was full or changed something: what is read from the
# deployments and replicas may then differ (the collector reads its targets again).
_fleet_revision = 0


def note_fleet_changed() -> None:
    """A pass was full or changed something."""
    global _fleet_revision
    _fleet_revision += 1


def fleet_revision() -> int:
    """How many passes of this process were full or changed something (0: no reconciler
    runs here)."""
    return _fleet_revision


class ChangeWatch:
    """Changes made by others, seen as audit events new since the last look."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] | None = None
        #: The SQLite file's commit counter just before the last query (None: not told).
        self.looked: int | None = None
        #: Whether anyone else may have committed since the last full pass (a query was
        #: needed since): only then is the resync's full pass due (`PassSchedule`).
        self.foreign = True

    def quiet(self) -> bool:
        """Nobody else has committed since the last query (SQLite only)."""
        return self.seen is not None and commits.unchanged_since(self.looked)

    def changed(self) -> bool:
        """Whether an event (or a repeat of one) was written by someone else since the
        last call; True on the first. On SQLite no query while the database file says
        nobody else has committed since the last one (serving/sqlite_commits.py). The
        query is written out, not built by the ORM: it runs every pass (about once a
        second), and the ORM's building of it cost more than the indexed query itself
        (no ordering either: the rows make a set)."""
        if self.quiet():
            return False
        self.foreign = True
        looked = counter()
        since = timezone.now() - timedelta(seconds=CHANGE_WINDOW_SECONDS)
        q = connection.ops.quote_name
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {q('id')}, {q('count')} FROM {q(AuditEvent._meta.db_table)} "
                f"WHERE {q('last_seen')} >= %s AND NOT ({q('actor')} = %s)",
                [connection.ops.adapt_datetimefield_value(since), OWN_ACTOR])
            rows = set(cursor.fetchall())
        changed = self.seen is None or bool(rows - self.seen)
        self.seen, self.looked = rows, looked
        return changed


def settled(deployment: Deployment, replicas: list[Replica], *, changed: bool,
            creates_replicas: bool, owns_pods: bool) -> bool:
    """Nothing will happen to this deployment until a probe falls due or someone changes
    it: each replica of an external endpoint ready or told unreachable (a local backend's
    replicas are checked on every pass, pods are read from their watch every pass)."""
    if changed or deployment.deleting or owns_pods:
        return False
    if creates_replicas:
        return not replicas
    return all(r.phase == Replica.Phase.READY
               or (r.phase == Replica.Phase.LOADING and bool(r.last_error))
               for r in replicas)


class PassSchedule:
    """When the next full pass is due, and which deployments a pass between visits."""

    def __init__(self) -> None:
        self.full_at = 0.0  # monotonic seconds; 0: the first pass is full
        self.watch = ChangeWatch()
        #: Deployments (by pk) visited on every pass until they settle.
        self.active: set[int] = set()
        #: Settled deployments: when their next probe falls due (monotonic seconds).
        self.probe_at: dict[int, float] = {}

    def full_due(self, requested: bool) -> bool:
        """Whether this pass must visit every deployment. The change watch is read on
        every call (before the pass), so a change committed during a pass is seen by the
        next."""
        changed = self.watch.changed()
        return requested or changed or self.resync_due(time.monotonic())

    def resync_due(self, now: float) -> bool:
        """RECONCILE_RESYNC_SECONDS since the last full pass, and a write nothing told
        may have come meanwhile: on SQLite only when the database file shows a commit by
        anyone else since then (a SQL shell's moves its counter too), elsewhere always."""
        return now >= self.full_at and self.watch.foreign

    def quiet(self) -> bool:
        """Whether a pass now would visit nothing and find no change: no full pass due,
        no deployment with work to do or a probe due, and (SQLite) no commit since the
        change watch last looked but this process's own that write no event
        (serving/sqlite_commits.py). Asks the database nothing, so the controllers can
        skip such a pass without handing it to a thread."""
        now = time.monotonic()
        return (not self.resync_due(now) and not self.active
                and all(at > now for at in self.probe_at.values()) and self.watch.quiet())

    def starting_full(self) -> None:
        """A full pass begins: every deployment is noted again."""
        self.full_at = time.monotonic() + settings.RECONCILE_RESYNC_SECONDS
        self.watch.foreign = not self.watch.quiet()
        self.active.clear()
        self.probe_at.clear()

    def due(self) -> set[int]:
        """The deployments a pass between full ones visits now."""
        now = time.monotonic()
        return self.active | {pk for pk, at in self.probe_at.items() if at <= now}

    def note(self, pk: int, is_settled: bool, next_probe: float) -> None:
        """Where a visited deployment stands after its pass."""
        if is_settled:
            self.active.discard(pk)
            self.probe_at[pk] = next_probe
        else:
            self.active.add(pk)
            self.probe_at.pop(pk, None)

    def forget(self, pk: int) -> None:
        """The deployment is gone."""
        self.active.discard(pk)
        self.probe_at.pop(pk, None)
