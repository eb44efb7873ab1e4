"""The reconciler of backends that own their pods (Kubernetes: `PodSetBackend`). The
platform starts and restarts the pods; each pass maps them to replica records, decides
which take traffic and which go first on a scale-down (draining them before the count is
lowered), and applies spec and count, backing off after a failed apply."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.utils import timezone

from controlplane.backends.base import BackendError, Member, PodSetBackend, backend_for
from controlplane.models import Deployment, Replica
from controlplane.reconciler.roles import assign_roles, removal_order
from controlplane.reconciler.status import (
    LOG_LINES_IN_ERRORS,
    event,
    restart_backoff,
    save,
    write_status,
)

logger = logging.getLogger(__name__)


class PodSetReconciler:
    """Reconciles the deployments of backends whose platform runs the pods."""

    def __init__(self) -> None:
        # Why a backend could not be read this pass (by Backend id), and per deployment
        # the failed applies (count, monotonic time of the next try, why).
        self.unreadable: dict[int, str] = {}
        self.apply_failures: dict[int, tuple[int, float, str]] = {}
        # Per deployment: the platform's messages already told (events once each), and
        # the members whose drain holds the count (for the event when it ends).
        self.platform_said: dict[int, set[str]] = {}
        self.holding: dict[int, set[str]] = {}

    def refresh(self, deployments: list[Deployment]) -> None:
        """Once per pass, each pod-set backend reads the platform (a failure is kept, and
        its deployments conclude nothing from it this pass)."""
        self.unreadable = {}
        seen: set[int] = set()
        for deployment in deployments:
            backend = backend_for(deployment.backend)
            if not backend.owns_pods or deployment.backend_id in seen:
                continue
            seen.add(deployment.backend_id)
            try:
                cast(PodSetBackend, backend).refresh()
            except BackendError as exc:
                self.unreadable[deployment.backend_id] = str(exc)

    def reconcile(self, deployment: Deployment, backend: PodSetBackend,
                  replicas: list[Replica]) -> bool:
        """The platform keeps the pods running; this pass maps them to replica records,
        decides which take traffic and which go first, and applies spec and count."""
        unreadable = self.unreadable.get(deployment.backend_id)
        if unreadable is not None:  # conclude nothing from a platform that cannot be read
            return write_status(deployment, replicas, [unreadable])
        members = {m.name: m for m in backend.members(deployment)}
        changed = self.sync_members(deployment, backend, replicas, members)
        if changed:
            replicas = list(Replica.objects.filter(deployment=deployment))
        problems: list[str] = []
        if deployment.deleting:
            return self.remove(deployment, backend, replicas, problems) or changed
        hold = None
        if not backend.scales_itself():
            changed |= self.mark_victims(deployment, backend, replicas, members)
            members = {m.name: m for m in backend.members(deployment)}  # marks seen at once
            hold = self.drain_hold(deployment, backend, replicas, members)
        changed |= assign_roles(
            deployment, [r for r in replicas if r.pod_name in members], load=backend.in_flight,
            relabel=lambda replica, role: backend.set_role(deployment, replica, role),
            leaving=frozenset(n for n, m in members.items() if m.removal_marked),
            everyone=backend.scales_itself())
        changed |= self.apply_spec(deployment, backend, problems, replicas=hold)
        problems += [f"{r.name}: {r.last_error}" for r in replicas
                     if r.phase != Replica.Phase.FAILED and r.last_error]
        problems += self.platform_problems(deployment, backend, replicas)
        return write_status(deployment, replicas, problems) or changed

    def remove(self, deployment: Deployment, backend: PodSetBackend,
               replicas: list[Replica], problems: list[str]) -> bool:
        """A deployment being deleted: remove what the platform holds of it; the record
        goes once that is gone and no replica is left."""
        try:
            gone = backend.remove(deployment)
        except BackendError as exc:
            gone = False
            problems.append(str(exc))
        if gone and not replicas:
            event(None, "deleted", f"deployment {deployment.name} deleted")
            deployment.delete()
            return True
        return write_status(deployment, replicas, problems)

    def platform_problems(self, deployment: Deployment, backend: PodSetBackend,
                          replicas: list[Replica]) -> list[str]:
        """The platform's own words on why members are missing or failing (a quota, Pod
        Security, scheduling, volumes, images, OOM kills), less what a replica's message
        already says; each distinct message is an event once, while it lasts."""
        told = [r.last_error.split(": ", 1)[1] for r in replicas
                if ": " in r.last_error]
        found = [p for p in backend.problems(deployment)
                 if not any(tail and tail in p for tail in told)]
        said = self.platform_said.get(deployment.pk, set())
        now: set[str] = set()
        for problem in found:
            key = problem.split(": ", 1)[-1]  # not the names: a new pod, the same trouble
            if key not in said and key not in now:
                event(deployment, "platform-warning", problem)
            now.add(key)
        if now:
            self.platform_said[deployment.pk] = now
        else:
            self.platform_said.pop(deployment.pk, None)
        return found

    def sync_members(self, deployment: Deployment, backend: PodSetBackend,
                     replicas: list[Replica], members: dict[str, Member]) -> bool:
        """One replica record per member: created when a pod appears, removed when it is
        gone, its phase, role and messages following the pod. A pod that turns ready is
        warmed up before it is called ready."""
        changed = False
        rows = {r.pod_name or r.name: r for r in replicas}
        for name, member in members.items():
            row = rows.get(name)
            if row is None:
                row = Replica.objects.create(
                    deployment=deployment, name=name, pod_name=name, role=member.role,
                    generation=member.generation or deployment.generation,
                    started_at=timezone.now())
                event(deployment, "replica-created", f"pod {name} created"
                      + (f" on {member.node}" if member.node else ""), replica=row)
                changed = True
            changed |= self.follow_member(deployment, backend, row, member)
        for name, row in rows.items():
            if name not in members:
                row.delete()
                event(deployment, "replica-stopped", f"pod {name} is gone", replica=row)
                changed = True
        return changed

    def follow_member(self, deployment: Deployment, backend: PodSetBackend, row: Replica,
                      member: Member) -> bool:
        """Bring one replica record in line with its member; events for what changed."""
        where = ", ".join(part for part in (member.devices, member.node) if part)
        fields: dict[str, Any] = {
            "endpoint": member.endpoint, "devices": where[:100], "role": member.role,
            "generation": member.generation or row.generation,
            "restart_count": member.restarts}
        phase = member.phase
        if member.deleting or member.removal_marked:  # going: no new requests
            phase = Replica.Phase.DRAINING
        elif phase == Replica.Phase.READY and row.phase != Replica.Phase.READY:
            try:
                backend.warm_up(deployment, row)
            except BackendError as exc:
                phase, fields["last_error"] = Replica.Phase.WARMING, str(exc)
            else:
                fields["ready_at"] = fields["last_health_at"] = timezone.now()
        if phase != Replica.Phase.WARMING:
            fields["last_error"] = member.message
        fields["phase"] = phase
        changed = {name: value for name, value in fields.items()
                   if getattr(row, name) != value}
        if not changed:
            return False
        save(row, **changed)
        if "phase" in changed:
            if phase == Replica.Phase.READY:
                took = row.time_to_ready()
                event(deployment, "replica-ready", f"{row.name} is ready" + (
                    f" ({took.total_seconds():.1f} s after it appeared)" if took else ""),
                    replica=row)
            elif phase == Replica.Phase.FAILED:
                tail = backend.logs(row, LOG_LINES_IN_ERRORS)
                event(deployment, "replica-crashed", f"{row.name}: {member.message}" + (
                    "; last log lines:\n" + "\n".join(tail) if tail else ""), replica=row)
            elif phase == Replica.Phase.DRAINING:
                event(deployment, "replica-draining", f"{row.name} is being removed",
                      replica=row)
        elif "last_error" in changed and row.last_error:
            event(deployment, "replica-waiting", f"{row.name}: {row.last_error}",
                  replica=row)
        return True

    def mark_victims(self, deployment: Deployment, backend: PodSetBackend,
                     replicas: list[Replica], members: dict[str, Member]) -> bool:
        """Before the count is lowered, choose who goes: members not ready first (as the
        ReplicaSet removes them first), then standby ones, then the least loaded active
        ones. A chosen member is marked to go first (the pod-deletion cost) and leaves
        routing at once (draining);
        the count is lowered once its streams are done (drain_hold). Members chosen
        stay chosen while the excess lasts; if the count rises again first, the ready
        ones among them are kept and serve again."""
        wanted = deployment.desired_replicas() + deployment.desired_standby()
        candidates = [r for r in replicas if r.generation == deployment.generation
                      and r.pod_name in members and not members[r.pod_name].deleting]
        excess = max(len(candidates) - wanted, 0)
        marked = sorted((r for r in candidates if members[r.pod_name].removal_marked),
                        key=lambda r: members[r.pod_name].phase == Replica.Phase.READY)
        changed = False
        for replica in marked[excess:]:  # the count rose again: ready ones first
            try:
                backend.mark_for_removal(replica, marked=False)
            except BackendError as exc:
                logger.warning("unmarking %s failed: %s", replica.name, exc)
                continue
            event(deployment, "replica-kept", f"{replica.name} stays: the count rose again "
                  f"before it was removed", replica=replica)
            changed = True
        needed = excess - len(marked)
        if needed <= 0:
            return changed
        seconds = settings.DRAIN_TIMEOUT_SECONDS
        unmarked = [r for r in candidates if not members[r.pod_name].removal_marked]
        for victim in sorted(unmarked, key=lambda r: removal_order(r, backend.in_flight)
                             )[:needed]:
            try:
                backend.mark_for_removal(victim)
            except BackendError as exc:
                logger.warning("marking %s for removal failed: %s", victim.name, exc)
                continue
            serving = victim.phase == Replica.Phase.READY
            save(victim, phase=Replica.Phase.DRAINING,
                 drain_deadline=timezone.now() + timedelta(seconds=seconds))
            event(deployment, "replica-chosen", f"{victim.name} goes at the scale-down" + (
                f": it takes no new requests and finishes its streams (up to {seconds} s) "
                f"before the count is lowered" if serving else ""), replica=victim)
            changed = True
        return changed

    def drain_hold(self, deployment: Deployment, backend: PodSetBackend,
                   replicas: list[Replica], members: dict[str, Member]) -> int | None:
        """The count to keep while members chosen to go still have requests in flight
        and their drain deadline (DRAIN_TIMEOUT_SECONDS, as for local replicas) has not
        passed; None once the count may be lowered. A released drain is not held again
        (its deadline is set to now, in the database, so a restart keeps it)."""
        marked = [r for r in replicas if r.pod_name in members
                  and members[r.pod_name].removal_marked and not members[r.pod_name].deleting]
        if not marked:
            self.holding.pop(deployment.pk, None)
            return None
        now = timezone.now()
        busy = [r for r in marked if r.drain_deadline is not None and now < r.drain_deadline
                and (backend.in_flight(r) or 0) > 0]
        if busy:
            self.holding[deployment.pk] = {r.name for r in marked}
            return deployment.desired_replicas() + deployment.desired_standby() + len(marked)
        held = self.holding.pop(deployment.pk, set())
        for replica in marked:
            late = replica.drain_deadline is None or replica.drain_deadline <= now
            if not late:
                save(replica, drain_deadline=now)
            if replica.name in held:
                event(deployment, "replica-drained", f"{replica.name} " + (
                    "reached its drain deadline" if late else "finished its streams")
                    + ": the count is lowered", replica=replica)
        return None

    def apply_spec(self, deployment: Deployment, backend: PodSetBackend,
                   problems: list[str], replicas: int | None = None) -> bool:
        """Apply spec and count (`replicas`: the count held while chosen members drain);
        after a failure, again only once its backoff has passed. What the apply put
        back or handed over becomes the deployment's events."""
        failure = self.apply_failures.get(deployment.pk)
        if failure and time.monotonic() < failure[1]:
            problems.append(failure[2])
            return False
        try:
            wrote = backend.apply(deployment, replicas=replicas)
        except BackendError as exc:
            count = failure[0] + 1 if failure else 1
            delay = restart_backoff(count).total_seconds()
            self.apply_failures[deployment.pk] = (count, time.monotonic() + delay, str(exc))
            problems.append(str(exc))
            if not failure or failure[2] != str(exc):
                event(deployment, "apply-failed", f"{exc}\nnext try in {delay:.0f} s")
            return False
        if failure:
            self.apply_failures.pop(deployment.pk, None)
            event(deployment, "applied", "the platform accepted the deployment again")
        if wrote:
            event(deployment, "applied", f"applied generation {deployment.generation}: "
                  f"{deployment.desired_replicas()} active, {deployment.desired_standby()} "
                  f"standby" + (f" ({replicas} pods while the ones chosen to go drain)"
                                if replicas is not None else ""))
        for action, message in backend.notices(deployment):
            event(deployment, action, message)
        return wrote

