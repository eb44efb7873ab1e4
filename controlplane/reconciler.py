"""The reconciler: level-triggered. Each pass reads desired state (deployments) and
observed state (replica records plus what the backend sees), moves every replica one step
through its phases, creates or drains replicas to reach the desired count, and writes
status. A pass with nothing to do writes nothing; a pass after any failure converges.

Phases of a replica: pending -> starting -> loading -> warming -> ready; draining -> gone.
A replica that dies goes to failed and is restarted after a capped exponential backoff.
Rollouts (a new generation: changed engine args, a restart) surge one new replica and drain
an old one only once a new one is ready.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from controlplane.backends.base import (
    AnyBackend,
    BackendError,
    Member,
    Observation,
    PodSetBackend,
    ReplicaBackend,
    backend_for,
)
from controlplane.models import Deployment, Replica
from controlplane.services import audit

logger = logging.getLogger(__name__)

ACTOR = "reconciler"
OBSERVED_PHASES = (Replica.Phase.STARTING, Replica.Phase.LOADING, Replica.Phase.WARMING,
                   Replica.Phase.READY)
LOG_LINES_IN_ERRORS = 15


def restart_backoff(restarts: int) -> timedelta:
    """5 s, 10 s, 20 s ... capped at RESTART_BACKOFF_MAX_SECONDS."""
    base = settings.RESTART_BACKOFF_BASE_SECONDS
    delay = min(base * 2 ** max(restarts - 1, 0), settings.RESTART_BACKOFF_MAX_SECONDS)
    return timedelta(seconds=delay)


@dataclass
class PassResult:
    deployments: int = 0
    changed: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def event(deployment: Deployment | None, action: str, message: str, *,
          replica: Replica | None = None) -> None:
    audit(ACTOR, action, deployment, message, replica=replica.name if replica else "")


class Reconciler:
    def __init__(self) -> None:
        self.orphans_checked = False
        # When each ready replica's health was last probed (monotonic seconds). Only paces
        # the probes; a restart loses nothing but one early probe.
        self.last_probe: dict[int, float] = {}
        self.started_at = timezone.now()
        self.known: set[int] = set()
        self.observations: dict[int, Observation] = {}
        self.probed: set[int] = set()
        # Pod-set backends: why a backend could not be read this pass (by Backend id), and
        # per deployment the failed applies (count, monotonic time of the next try, why).
        self.unreadable: dict[int, str] = {}
        self.apply_failures: dict[int, tuple[int, float, str]] = {}
        # Per deployment: the platform's messages already told (events once each), and
        # the members whose drain holds the count (for the event when it ends).
        self.platform_said: dict[int, set[str]] = {}
        self.holding: dict[int, set[str]] = {}

    # --- the pass --------------------------------------------------------------------

    def reconcile_all(self) -> PassResult:
        started = time.perf_counter()
        result = PassResult()
        deployments = list(Deployment.objects.select_related("model", "backend")
                           .prefetch_related("replica_set"))
        if not self.orphans_checked:
            self.cleanup_orphans(deployments)
        self.refresh_pod_sets(deployments)
        self.observations = self.observe_all(deployments)
        for deployment in deployments:
            result.deployments += 1
            try:
                if self.reconcile_deployment(deployment):
                    result.changed += 1
            except Exception as exc:  # one deployment's failure must not stop the others
                logger.exception("reconciling %s failed", deployment.name)
                result.errors.append(f"{deployment.name}: {exc}")
        result.seconds = time.perf_counter() - started
        return result

    def observe_all(self, deployments: list[Deployment]) -> dict[int, Observation]:
        """Look at every running replica at once (probes are network calls; run side by
        side they cost one timeout, not one per replica)."""
        due: list[tuple[Deployment, Replica, bool]] = []
        now = time.monotonic()
        for deployment in deployments:
            if backend_for(deployment.backend).owns_pods:
                continue  # its members are read by refresh_pod_sets
            for replica in deployment.replica_set.all():
                if replica.phase not in OBSERVED_PHASES:
                    continue
                probe = replica.phase != Replica.Phase.READY or now - self.last_probe.get(
                    replica.pk, 0.0) >= settings.HEALTH_CHECK_SECONDS
                due.append((deployment, replica, probe))
        probed = [item for item in due if item[2]]
        observations: dict[int, Observation] = {}
        for deployment, replica, probe in due:
            if not probe:
                observations[replica.pk] = replica_backend(deployment).observe(
                    deployment, replica, probe_health=False)
        if probed:
            with ThreadPoolExecutor(max_workers=min(32, len(probed))) as pool:
                results = pool.map(lambda item: replica_backend(item[0]).observe(
                    item[0], item[1], probe_health=True), probed)
                for (_, replica, _), observation in zip(probed, results, strict=True):
                    observations[replica.pk] = observation
                    self.last_probe[replica.pk] = time.monotonic()
        self.probed = {replica.pk for _, replica, _ in probed}
        return observations

    def refresh_pod_sets(self, deployments: list[Deployment]) -> None:
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

    def cleanup_orphans(self, deployments: list[Deployment]) -> None:
        """Once per controller start: stop servers no replica record knows."""
        known = {r.name for d in deployments for r in d.replica_set.all()}
        seen: set[int] = set()
        for deployment in deployments:
            if deployment.backend_id in seen:
                continue
            seen.add(deployment.backend_id)
            backend = backend_for(deployment.backend)
            if backend.owns_pods:
                continue  # everything it makes is removed with its deployment
            try:
                stopped = cast(ReplicaBackend, backend).cleanup_orphans(known)
            except BackendError:
                continue
            for name in stopped:
                event(None, "orphan-stopped", f"stopped server {name}, which no replica "
                                              f"record knew")
        self.orphans_checked = True

    def reconcile_deployment(self, deployment: Deployment) -> bool:
        chosen: AnyBackend = backend_for(deployment.backend)
        replicas = list(deployment.replica_set.all())
        if chosen.owns_pods:
            return self.reconcile_pod_set(deployment, cast(PodSetBackend, chosen), replicas)
        backend = cast(ReplicaBackend, chosen)
        changed = False
        for replica in replicas:
            changed |= self.step_replica(deployment, backend, replica)
        live = [r for r in replicas if r.phase not in (Replica.Phase.DRAINING,
                                                       Replica.Phase.STOPPED)]
        if backend.creates_replicas:
            changed |= self.scale(deployment, live)
            changed |= self.assign_roles(deployment, live, load=backend.in_flight)
        else:
            changed |= self.track_endpoint(deployment, live)
        changed |= self.remove_stopped(deployment, replicas)
        if changed:
            replicas = list(Replica.objects.filter(deployment=deployment))
        changed |= self.write_status(deployment, replicas)
        if deployment.deleting and not deployment.replica_set.exists():
            event(None, "deleted", f"deployment {deployment.name} deleted")
            deployment.delete()
            return True
        return changed

    # --- one replica, one step -------------------------------------------------------

    def step_replica(self, deployment: Deployment, backend: ReplicaBackend,
                     replica: Replica) -> bool:
        phase = replica.phase
        now = timezone.now()
        if phase == Replica.Phase.PENDING:
            return self.start_replica(deployment, backend, replica, now)
        if phase == Replica.Phase.FAILED:
            wanted = replica.generation == deployment.generation and not deployment.deleting
            if wanted and replica.restart_due():
                replica.phase = Replica.Phase.PENDING
                return self.start_replica(deployment, backend, replica, now)
            return False
        if phase == Replica.Phase.DRAINING:
            return self.drain(deployment, backend, replica, now)
        if phase == Replica.Phase.STOPPED:
            return False
        observation = self.observations.get(replica.pk)
        if observation is None:  # a replica that changed phase during this pass
            observation = backend.observe(deployment, replica)
        if not observation.alive:
            return self.crashed(deployment, backend, replica, now)
        if replica.pk not in self.known:
            self.known.add(replica.pk)
            if replica.pid and replica.started_at and replica.started_at < self.started_at:
                event(deployment, "replica-adopted", f"{replica.name} (pid {replica.pid}) was "
                      f"running before this controller started and is adopted",
                      replica=replica)
        if phase == Replica.Phase.STARTING:
            return self.save(replica, phase=Replica.Phase.LOADING)
        if not observation.healthy:
            return self.unhealthy(deployment, backend, replica, now, observation.message)
        if phase in (Replica.Phase.LOADING, Replica.Phase.WARMING):
            return self.warm(deployment, backend, replica, now)
        # Ready and healthy: record a probe that happened, but not more often than needed.
        if replica.pk in self.probed and (replica.last_health_at is None or now - replica.
                                          last_health_at > timedelta(
                                              seconds=settings.HEALTH_RECORD_SECONDS)):
            return self.save(replica, last_health_at=now)
        return False

    def start_replica(self, deployment: Deployment, backend: ReplicaBackend,
                      replica: Replica, now: datetime) -> bool:
        try:
            backend.start(deployment, replica)
        except BackendError as exc:
            return self.fail(deployment, replica, now, f"could not start: {exc}")
        replica.phase = Replica.Phase.STARTING
        replica.started_at, replica.ready_at, replica.next_restart_at = now, None, None
        replica.last_health_at = None
        replica.save()
        event(deployment, "replica-started",
              f"{replica.name} started (pid {replica.pid}, {replica.endpoint})", replica=replica)
        return True

    def warm(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
             now: datetime) -> bool:
        if replica.phase != Replica.Phase.WARMING:
            self.save(replica, phase=Replica.Phase.WARMING)
        try:
            backend.warm_up(deployment, replica)
        except BackendError as exc:
            started = replica.started_at or now
            if now - started > timedelta(seconds=settings.REPLICA_STARTUP_TIMEOUT_SECONDS):
                return self.crashed(deployment, backend, replica, now,
                                    reason=f"kept failing its warm-up ({exc})")
            if replica.last_error != str(exc):
                self.save(replica, last_error=str(exc))
            return True
        ready_at = timezone.now()
        self.save(replica, phase=Replica.Phase.READY, ready_at=ready_at, last_health_at=ready_at,
                  last_error="")
        took = replica.time_to_ready()
        event(deployment, "replica-ready", f"{replica.name} is ready"
              + (f" ({took.total_seconds():.1f} s after start)" if took else ""),
              replica=replica)
        return True

    def unhealthy(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
                  now: datetime, message: str) -> bool:
        if replica.phase == Replica.Phase.READY:
            # A ready replica that stops answering for a while is restarted.
            last = replica.last_health_at or replica.ready_at or now
            if now - last > timedelta(seconds=settings.HEALTH_FAILURE_SECONDS):
                return self.crashed(deployment, backend, replica, now,
                                    reason=f"stopped answering /health ({message})")
            return False
        started = replica.started_at or now
        if now - started > timedelta(seconds=settings.REPLICA_STARTUP_TIMEOUT_SECONDS):
            return self.crashed(deployment, backend, replica, now, reason=(
                f"not healthy {settings.REPLICA_STARTUP_TIMEOUT_SECONDS} s after start"))
        return False

    def crashed(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
                now: datetime, reason: str = "exited") -> bool:
        # Whatever the reason, nothing of the replica may linger (its engine processes).
        backend.stop(replica, force=True)
        tail = backend.logs(replica, LOG_LINES_IN_ERRORS)
        detail = f"{replica.name} {reason}" + ("; last log lines:\n" + "\n".join(tail)
                                               if tail else "")
        return self.fail(deployment, replica, now, detail, crashed=True)

    def fail(self, deployment: Deployment, replica: Replica, now: datetime, message: str,
             *, crashed: bool = False) -> bool:
        replica.restart_count += 1
        delay = restart_backoff(replica.restart_count)
        replica.phase = Replica.Phase.FAILED
        replica.last_error = message
        replica.next_restart_at = now + delay
        replica.ready_at = None
        replica.save()
        event(deployment, "replica-crashed" if crashed else "replica-failed",
              f"{message}\nrestart {replica.restart_count} in {delay.total_seconds():.0f} s",
              replica=replica)
        return True

    def drain(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
              now: datetime) -> bool:
        if replica.stop_requested_at is None:
            in_flight = backend.in_flight(replica)
            deadline = replica.drain_deadline or now
            if in_flight and now < deadline:
                return False
            backend.stop(replica, force=False)
            return self.save(replica, stop_requested_at=now)
        if backend.is_gone(replica):
            event(deployment, "replica-stopped", f"{replica.name} stopped", replica=replica)
            return self.save(replica, phase=Replica.Phase.STOPPED)
        if now - replica.stop_requested_at > timedelta(seconds=settings.STOP_GRACE_SECONDS):
            backend.stop(replica, force=True)
        return False

    # --- pod-set backends (Kubernetes) -----------------------------------------------

    def reconcile_pod_set(self, deployment: Deployment, backend: PodSetBackend,
                          replicas: list[Replica]) -> bool:
        """The platform keeps the pods running; this pass maps them to replica records,
        decides which take traffic and which go first, and applies spec and count."""
        unreadable = self.unreadable.get(deployment.backend_id)
        if unreadable is not None:  # conclude nothing from a platform that cannot be read
            return self.write_status(deployment, replicas, [unreadable])
        members = {m.name: m for m in backend.members(deployment)}
        changed = self.sync_members(deployment, backend, replicas, members)
        if changed:
            replicas = list(Replica.objects.filter(deployment=deployment))
        problems: list[str] = []
        if deployment.deleting:
            try:
                gone = backend.remove(deployment)
            except BackendError as exc:
                gone = False
                problems.append(str(exc))
            if gone and not replicas:
                event(None, "deleted", f"deployment {deployment.name} deleted")
                deployment.delete()
                return True
            return self.write_status(deployment, replicas, problems) or changed
        hold = None
        if not backend.scales_itself():
            changed |= self.mark_victims(deployment, backend, replicas, members)
            members = {m.name: m for m in backend.members(deployment)}  # marks seen at once
            hold = self.drain_hold(deployment, backend, replicas, members)
        changed |= self.assign_roles(
            deployment, [r for r in replicas if r.pod_name in members], load=backend.in_flight,
            relabel=lambda replica, role: backend.set_role(deployment, replica, role),
            leaving=frozenset(n for n, m in members.items() if m.removal_marked),
            everyone=backend.scales_itself())
        changed |= self.apply_spec(deployment, backend, problems, replicas=hold)
        problems += [f"{r.name}: {r.last_error}" for r in replicas
                     if r.phase != Replica.Phase.FAILED and r.last_error]
        problems += self.platform_problems(deployment, backend, replicas)
        return self.write_status(deployment, replicas, problems) or changed

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
                self.known.discard(row.pk)
                event(deployment, "replica-stopped", f"pod {name} is gone", replica=row)
                changed = True
        return changed

    def follow_member(self, deployment: Deployment, backend: PodSetBackend, row: Replica,
                      member: Member) -> bool:
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
        self.save(row, **changed)
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
        """Before the count is lowered, choose who goes: standby members first (those not
        ready before ready ones), then the least loaded active ones. A chosen member is
        marked to go first (the pod-deletion cost) and leaves routing at once (draining);
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

        def order(replica: Replica) -> tuple[int, int, int]:
            standby = replica.role == Replica.Role.STANDBY
            ready = replica.phase == Replica.Phase.READY
            load = backend.in_flight(replica) if ready and not standby else 0
            return (0 if standby else 1, 1 if ready else 0, load if load is not None else 0)

        seconds = settings.DRAIN_TIMEOUT_SECONDS
        unmarked = [r for r in candidates if not members[r.pod_name].removal_marked]
        for victim in sorted(unmarked, key=order)[:needed]:
            try:
                backend.mark_for_removal(victim)
            except BackendError as exc:
                logger.warning("marking %s for removal failed: %s", victim.name, exc)
                continue
            serving = victim.phase == Replica.Phase.READY
            self.save(victim, phase=Replica.Phase.DRAINING,
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
                self.save(replica, drain_deadline=now)
            if replica.name in held:
                event(deployment, "replica-drained", f"{replica.name} " + (
                    "reached its drain deadline" if late else "finished its streams")
                    + ": the count is lowered", replica=replica)
        return None

    def assign_roles(self, deployment: Deployment, replicas: list[Replica], *,
                     load: Callable[[Replica], int | None],
                     relabel: Callable[[Replica, str], None] | None = None,
                     leaving: frozenset[str] = frozenset(), everyone: bool = False) -> bool:
        """Ready replicas of the current generation take traffic up to the desired active
        count; the rest are warm standby (outside the route table). A standby is promoted
        at once when the count rises (no restart: on Kubernetes a label, `relabel`); on a
        scale-down the least loaded active ones (among equals the newest, whose caches are
        coldest) move to the standby pool. Replicas in `leaving` (chosen to go) do not
        count."""
        staying = [r for r in replicas if r.phase == Replica.Phase.READY
                   and r.generation == deployment.generation and r.name not in leaving]
        active = [r for r in staying if r.role == Replica.Role.ACTIVE]
        standby = [r for r in staying if r.role == Replica.Role.STANDBY]
        wanted = len(staying) if everyone else deployment.desired_replicas()
        moves: list[tuple[Replica, str]] = []
        if len(active) < wanted:
            moves = [(r, Replica.Role.ACTIVE) for r in standby[:wanted - len(active)]]
        elif len(active) > wanted:
            loads = {r.pk: load(r) or 0 for r in active}
            extra = sorted(active, key=lambda r: (loads[r.pk], -(
                r.ready_at.timestamp() if r.ready_at else 0.0)))[:len(active) - wanted]
            moves = [(r, Replica.Role.STANDBY) for r in extra]
        changed = False
        for replica, role in moves:
            if relabel is not None:
                try:
                    relabel(replica, role)
                except BackendError as exc:
                    logger.warning("relabelling %s failed: %s", replica.name, exc)
                    continue
            self.save(replica, role=role)
            event(deployment, "replica-promoted" if role == Replica.Role.ACTIVE else
                  "replica-standby", f"{replica.name} " + (
                      "promoted: takes traffic" if role == Replica.Role.ACTIVE else
                      "moved to the warm standby pool: takes no new traffic"),
                  replica=replica)
            changed = True
        return changed

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

    # --- counts ----------------------------------------------------------------------

    def scale(self, deployment: Deployment, live: list[Replica]) -> bool:
        """Reach the desired count; roll out a new generation one surge replica at a time,
        never dropping below the desired number of ready replicas while it lasts."""
        wanted = deployment.desired_replicas() + deployment.desired_standby()
        current = [r for r in live if r.generation == deployment.generation]
        outdated = [r for r in live if r.generation != deployment.generation]
        changed = False
        surge = 1 if outdated and wanted else 0
        for _ in range(max(0, min(wanted - len(current), wanted + surge - len(live)))):
            self.create_replica(deployment)
            changed = True
        ready = sum(1 for r in live if r.phase == Replica.Phase.READY)
        for victim in sorted(outdated, key=victim_order):
            if victim.phase == Replica.Phase.READY:
                if wanted and ready - 1 < wanted:
                    continue  # keep serving until a new replica is ready in its place
                ready -= 1
            self.start_draining(deployment, victim)
            changed = True
        for victim in sorted(current, key=victim_order)[: max(len(current) - wanted, 0)]:
            self.start_draining(deployment, victim)
            changed = True
        return changed

    def create_replica(self, deployment: Deployment) -> Replica:
        Deployment.objects.filter(pk=deployment.pk).update(
            replica_serial=F("replica_serial") + 1)
        deployment.replica_serial = Deployment.objects.values_list(
            "replica_serial", flat=True).get(pk=deployment.pk)
        replica = Replica.objects.create(
            deployment=deployment, name=f"{deployment.name}-{deployment.replica_serial}",
            generation=deployment.generation)
        event(deployment, "replica-created", f"{replica.name} created", replica=replica)
        return replica

    def start_draining(self, deployment: Deployment, replica: Replica) -> None:
        now = timezone.now()
        if replica.phase in (Replica.Phase.READY, Replica.Phase.WARMING):
            deadline = now + timedelta(seconds=settings.DRAIN_TIMEOUT_SECONDS)
            self.save(replica, phase=Replica.Phase.DRAINING, drain_deadline=deadline)
        elif replica.pid:
            self.save(replica, phase=Replica.Phase.DRAINING, drain_deadline=now)
        else:
            self.save(replica, phase=Replica.Phase.STOPPED)
        event(deployment, "replica-draining", f"{replica.name} taken out of service",
              replica=replica)

    def track_endpoint(self, deployment: Deployment, live: list[Replica]) -> bool:
        """External backends: one replica record stands for the endpoint."""
        wanted = min(deployment.desired_replicas(), 1)
        changed = False
        if wanted and not live:
            replica = self.create_replica(deployment)
            replica.phase = Replica.Phase.PENDING
            live = [replica]
            changed = True
        if not wanted:
            for replica in live:
                self.save(replica, phase=Replica.Phase.STOPPED)
                changed = True
        return changed

    def remove_stopped(self, deployment: Deployment, replicas: list[Replica]) -> bool:
        stopped = [r.pk for r in replicas if r.phase == Replica.Phase.STOPPED]
        if not stopped:
            return False
        Replica.objects.filter(pk__in=stopped).delete()
        for pk in stopped:
            self.last_probe.pop(pk, None)
            self.known.discard(pk)
        return True

    # --- status ----------------------------------------------------------------------

    def write_status(self, deployment: Deployment, replicas: list[Replica],
                     problems: list[str] | None = None) -> bool:
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
        previous = {c["type"]: c for c in deployment.conditions}
        merged = []
        for item in conditions:
            old = previous.get(item["type"])
            if old and old["status"] == item["status"]:
                item["last_transition"] = old.get("last_transition", item["last_transition"])
            merged.append(item)
        observed = deployment.generation if not outdated and len(ready) >= wanted else \
            deployment.observed_generation
        if merged == deployment.conditions and observed == deployment.observed_generation:
            return False
        deployment.conditions = merged
        deployment.observed_generation = observed
        Deployment.objects.filter(pk=deployment.pk).update(conditions=merged,
                                                           observed_generation=observed)
        return True

    @staticmethod
    def save(replica: Replica, **fields: Any) -> bool:
        for name, value in fields.items():
            setattr(replica, name, value)
        replica.save(update_fields=list(fields))
        return True


def promote_now(deployment_pk: int) -> bool:
    """Promote ready standby replicas up to the desired active count right away, outside
    a reconcile pass (which may be busy probing loaded replicas), and hand the gateway the
    new route table: the autoscaler calls this after a scale-up. Idempotent with the pass's
    own role assignment, which reads deployment and replicas together."""
    from controlplane.routing import publish_routes

    deployment = Deployment.objects.select_related("backend").filter(
        pk=deployment_pk).first()
    if deployment is None or deployment.deleting:
        return False
    replicas = list(deployment.replica_set.all())
    chosen = backend_for(deployment.backend)
    relabel = None
    if chosen.owns_pods:
        pod_set = cast(PodSetBackend, chosen)
        replicas = [r for r in replicas if r.pod_name]

        def relabel(replica: Replica, role: str) -> None:
            pod_set.set_role(deployment, replica, role)

    staying = [r for r in replicas if r.phase == Replica.Phase.READY]
    active = sum(1 for r in staying if r.role == Replica.Role.ACTIVE)
    if active >= deployment.desired_replicas():
        return False  # only promotions here; moves to the pool wait for a pass
    changed = Reconciler().assign_roles(deployment, replicas, load=chosen.in_flight,
                                        relabel=relabel)
    if changed:
        publish_routes()
    return changed


def replica_backend(deployment: Deployment) -> ReplicaBackend:
    return cast(ReplicaBackend, backend_for(deployment.backend))


def victim_order(replica: Replica) -> tuple[int, int, float]:
    """Who goes first: replicas not serving, then warm standby ones, then the newest."""
    serving = replica.phase == Replica.Phase.READY
    created = replica.created_at.timestamp() if replica.created_at else 0.0
    return (1 if serving else 0, 1 if replica.role == Replica.Role.ACTIVE else 0, -created)


def condition(kind: str, status: bool, message: str) -> dict[str, str]:
    return {"type": kind, "status": "True" if status else "False", "message": message,
            "last_transition": timezone.now().isoformat()}

