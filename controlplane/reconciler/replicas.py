"""The reconciler of backends that run each replica (local processes, external
endpoints: `ReplicaBackend`). It moves every replica one step through its phases per pass,
creates or drains replicas to reach the desired count, and rolls out new generations.

Phases of a replica: pending -> starting -> loading -> warming -> ready; draining -> gone.
A replica that dies goes to failed and is restarted after a capped exponential backoff.
Rollouts (a new generation: changed engine args, a restart) surge one new replica and drain
an old one only once a new one is ready.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import cast

from django.conf import settings
from django.db import DatabaseError
from django.db.models import F
from django.utils import timezone

from controlplane.backends.base import BackendError, Observation, ReplicaBackend, backend_for
from controlplane.models import Deployment, Replica
from controlplane.reconciler.probes import ProbePacer
from controlplane.reconciler.roles import assign_roles, victim_order
from controlplane.reconciler.status import (
    LOG_LINES_IN_ERRORS,
    event,
    restart_backoff,
    save,
    write_status,
)
from serving.sqlite_commits import eventless_transaction

OBSERVED_PHASES = (Replica.Phase.STARTING, Replica.Phase.LOADING, Replica.Phase.WARMING,
                   Replica.Phase.READY)


def replica_backend(deployment: Deployment) -> ReplicaBackend:
    """The deployment's backend, known to run each replica."""
    return cast(ReplicaBackend, backend_for(deployment.backend))


class ReplicaReconciler:
    """Reconciles the deployments of backends that run each replica themselves."""

    def __init__(self) -> None:
        self.orphans_checked = False
        # When each replica was last probed, and its failed probes in a row. Only paces
        # the probes; a restart loses nothing but one early probe.
        self.pacer = ProbePacer()
        self.last_probe = self.pacer.last_probe
        self.started_at = timezone.now()
        self.known: set[int] = set()
        self.observations: dict[int, Observation] = {}
        self.probed: set[int] = set()
        self.healthy_now: list[int] = []  # ready replicas whose probe this pass answered
        # When this reconciler first saw each draining replica (monotonic seconds).
        self.draining_since: dict[int, float] = {}

    # --- once per pass ---------------------------------------------------------------

    def observe_all(self, deployments: list[Deployment],
                    known: dict[int, Observation] | None = None) -> None:
        """Look at every running replica at once (probes are network calls; run side by
        side they cost one timeout, not one per replica). `known`: replicas probed just
        before this pass (controlplane/reconciler/probes.py:probe_settled), not probed
        again."""
        known = known or {}
        due: list[tuple[Deployment, Replica, bool]] = []
        now = time.monotonic()
        for deployment in deployments:
            backend = backend_for(deployment.backend)
            if backend.owns_pods:
                continue  # its members are read by the pod-set reconciler
            for replica in deployment.replica_set.all():
                if replica.phase not in OBSERVED_PHASES or replica.pk in known:
                    continue
                # Paced per replica (controlplane/reconciler/probes.py).
                probe = self.pacer.due(replica, backend.creates_replicas, now)
                due.append((deployment, replica, probe))
        probed = [(deployment, replica) for deployment, replica, probe in due if probe]
        answered = self.pacer.probe(probed)
        observations: dict[int, Observation] = dict(known)
        for deployment, replica, _ in due:
            # Not due, or its probe still running (an endpoint slow to fail): looked at
            # without a probe this pass.
            if replica.pk not in answered:
                observations[replica.pk] = replica_backend(deployment).observe(
                    deployment, replica, probe_health=False)
        observations.update(answered)
        self.probed = set(answered) | set(known)
        self.observations = observations

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

    # --- one deployment --------------------------------------------------------------

    def reconcile(self, deployment: Deployment, backend: ReplicaBackend,
                  replicas: list[Replica]) -> bool:
        """One step for each replica, then the count, the roles and the status; True when
        anything changed."""
        changed = False
        for replica in replicas:
            changed |= self.step_replica(deployment, backend, replica)
        live = [r for r in replicas if r.phase not in (Replica.Phase.DRAINING,
                                                       Replica.Phase.STOPPED)]
        if backend.creates_replicas:
            changed |= self.scale(deployment, live)
            changed |= assign_roles(deployment, live, load=backend.in_flight)
        else:
            changed |= self.track_endpoint(deployment, live)
        changed |= self.remove_stopped(replicas)
        if changed:
            replicas = list(Replica.objects.filter(deployment=deployment))
        # An endpoint something else runs that stopped answering is a problem too, though
        # not a failed replica (it is never restarted).
        unreachable = [f"{r.name}: {r.last_error}" for r in replicas
                       if not backend.creates_replicas and r.last_error
                       and r.phase == Replica.Phase.LOADING]
        changed |= write_status(deployment, replicas, unreachable)
        if deployment.deleting and not deployment.replica_set.exists():
            event(None, "deleted", f"deployment {deployment.name} deleted")
            deployment.delete()
            return True
        return changed

    # --- one replica, one step -------------------------------------------------------

    def step_replica(self, deployment: Deployment, backend: ReplicaBackend,
                     replica: Replica) -> bool:
        """Move one replica one step through its phases; True when it changed."""
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
        if not observation.probed and phase != Replica.Phase.READY:
            return False  # its probe is not due: nothing new is known
        if not observation.alive:
            if not backend.creates_replicas:
                return self.unreachable(deployment, replica, now, observation.message)
            return self.crashed(deployment, backend, replica, now)
        if replica.pk not in self.known:
            self.known.add(replica.pk)
            if replica.pid and replica.started_at and replica.started_at < self.started_at:
                event(deployment, "replica-adopted", f"{replica.name} (pid {replica.pid}) was "
                      f"running before this controller started and is adopted",
                      replica=replica)
        if phase == Replica.Phase.STARTING:
            return save(replica, phase=Replica.Phase.LOADING)
        if not observation.healthy:
            return self.unhealthy(deployment, backend, replica, now, observation.message)
        if phase in (Replica.Phase.LOADING, Replica.Phase.WARMING):
            return self.warm(deployment, backend, replica, now)
        # Ready and healthy: record a probe that happened, but not more often than needed,
        # all of a pass's in one write (`record_health`). A record, not a change: nothing
        # routed or shown as status moves with it.
        if replica.pk in self.probed and (replica.last_health_at is None or now - replica.
                                          last_health_at > timedelta(
                                              seconds=settings.HEALTH_RECORD_SECONDS)):
            replica.last_health_at = now
            self.healthy_now.append(replica.pk)
        return False

    def record_health(self) -> None:
        """Write the pass's successful probes, in one statement."""
        if self.healthy_now:
            with eventless_transaction():  # no event: the change watch stays quiet
                Replica.objects.filter(pk__in=self.healthy_now).update(
                    last_health_at=timezone.now())
            self.healthy_now = []

    def start_replica(self, deployment: Deployment, backend: ReplicaBackend,
                      replica: Replica, now: datetime) -> bool:
        """Start the replica's server; a failure to start counts as a failure (backoff)."""
        try:
            backend.start(deployment, replica)
        except BackendError as exc:
            return self.fail(deployment, replica, now, f"could not start: {exc}")
        replica.phase = Replica.Phase.STARTING
        replica.started_at, replica.ready_at, replica.next_restart_at = now, None, None
        replica.last_health_at = None
        try:
            replica.save()
        except DatabaseError:
            # The server runs but no record says so (the database went away mid-pass):
            # it is stopped, or the pass after the outage would start a second one.
            backend.stop(replica, force=True)
            raise
        event(deployment, "replica-started",
              f"{replica.name} started (pid {replica.pid}, {replica.endpoint})", replica=replica)
        return True

    def warm(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
             now: datetime) -> bool:
        """Send the warm-up request; the replica is ready once it succeeds."""
        if replica.phase != Replica.Phase.WARMING:
            save(replica, phase=Replica.Phase.WARMING)
        try:
            backend.warm_up(deployment, replica)
        except BackendError as exc:
            started = replica.started_at or now
            if now - started > timedelta(seconds=settings.REPLICA_STARTUP_TIMEOUT_SECONDS):
                return self.crashed(deployment, backend, replica, now,
                                    reason=f"kept failing its warm-up ({exc})")
            if replica.last_error != str(exc):
                save(replica, last_error=str(exc))
            return True
        ready_at = timezone.now()
        save(replica, phase=Replica.Phase.READY, ready_at=ready_at, last_health_at=ready_at,
             last_error="")
        took = replica.time_to_ready()
        event(deployment, "replica-ready", f"{replica.name} is ready"
              + (f" ({took.total_seconds():.1f} s after start)" if took else ""),
              replica=replica)
        return True

    def unhealthy(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
                  now: datetime, message: str) -> bool:
        """A failed health check: tolerated for a while, then the replica is restarted."""
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

    def unreachable(self, deployment: Deployment, replica: Replica, now: datetime,
                    message: str) -> bool:
        """An endpoint something else runs stopped answering: it is probed, never
        restarted. A ready one is tolerated for HEALTH_FAILURE_SECONDS (the gateway's own
        failure count takes it out of routing meanwhile), then leaves the route table
        (phase `loading`) with the error, until a probe is answered again."""
        if replica.phase == Replica.Phase.READY:
            last = replica.last_health_at or replica.ready_at or now
            if now - last <= timedelta(seconds=settings.HEALTH_FAILURE_SECONDS):
                return False
        elif replica.phase == Replica.Phase.LOADING and replica.last_error:
            if replica.last_error == message:
                return False
            return save(replica, last_error=message)  # another error, no new event
        save(replica, phase=Replica.Phase.LOADING, last_error=message, ready_at=None)
        event(deployment, "replica-unreachable", f"{replica.name}: {message}; probed again "
              f"after {settings.HEALTH_CHECK_SECONDS:g} s, then less often while it keeps "
              f"failing (at least every {settings.HEALTH_BACKOFF_MAX_SECONDS:g} s), and "
              f"routed to again once it answers (it is not restarted: something else runs "
              f"it)", replica=replica)
        return True

    def crashed(self, deployment: Deployment, backend: ReplicaBackend, replica: Replica,
                now: datetime, reason: str = "exited") -> bool:
        """Stop what is left of the replica and fail it with the last lines of its log."""
        # Whatever the reason, nothing of the replica may linger (its engine processes).
        backend.stop(replica, force=True)
        tail = backend.logs(replica, LOG_LINES_IN_ERRORS)
        detail = f"{replica.name} {reason}" + ("; last log lines:\n" + "\n".join(tail)
                                               if tail else "")
        return self.fail(deployment, replica, now, detail, crashed=True)

    def fail(self, deployment: Deployment, replica: Replica, now: datetime, message: str,
             *, crashed: bool = False) -> bool:
        """Mark the replica failed; it is restarted after the backoff of its restart count."""
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
        """Wait for the streams in flight (up to the deadline), stop, then force after a grace."""
        if replica.stop_requested_at is None:
            deadline = replica.drain_deadline or now
            if now < deadline and (self.routes_settling(replica)
                                   or self.still_busy(backend, replica)):
                return False
            backend.stop(replica, force=False)
            return save(replica, stop_requested_at=now)
        if backend.is_gone(replica):
            event(deployment, "replica-stopped", f"{replica.name} stopped", replica=replica)
            return save(replica, phase=Replica.Phase.STOPPED)
        if now - replica.stop_requested_at > timedelta(seconds=settings.STOP_GRACE_SECONDS):
            backend.stop(replica, force=True)
        return False

    def routes_settling(self, replica: Replica) -> bool:
        """Gateways in other processes read the route table from Redis every
        GATEWAY_LOAD_SCRAPE_SECONDS: a replica leaving routing is not stopped before they
        have all read the table without it (twice that interval after it began to drain),
        so none sends it a request it would refuse. One process alone reads it at once."""
        if not settings.REDIS_URL:
            return False
        since = self.draining_since.setdefault(replica.pk, time.monotonic())
        return time.monotonic() - since < 2 * settings.GATEWAY_LOAD_SCRAPE_SECONDS

    @staticmethod
    def still_busy(backend: ReplicaBackend, replica: Replica) -> bool:
        """Requests in flight, or a count that cannot be read (its /metrics slow or
        silent) while the process lives: a drain never cuts streams on a guess."""
        in_flight = backend.in_flight(replica)
        if in_flight is None:
            return not backend.is_gone(replica)
        return in_flight > 0

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
        """A new replica record (pending), named with the deployment's next serial number."""
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
        """Take the replica out of service; it drains before it stops."""
        now = timezone.now()
        if replica.phase in (Replica.Phase.READY, Replica.Phase.WARMING):
            deadline = now + timedelta(seconds=settings.DRAIN_TIMEOUT_SECONDS)
            save(replica, phase=Replica.Phase.DRAINING, drain_deadline=deadline)
        elif replica.pid:
            save(replica, phase=Replica.Phase.DRAINING, drain_deadline=now)
        else:
            save(replica, phase=Replica.Phase.STOPPED)
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
                save(replica, phase=Replica.Phase.STOPPED)
                changed = True
        return changed

    def remove_stopped(self, replicas: list[Replica]) -> bool:
        """Delete the records of stopped replicas (and what this reconciler kept of them)."""
        stopped = [r.pk for r in replicas if r.phase == Replica.Phase.STOPPED]
        if not stopped:
            return False
        Replica.objects.filter(pk__in=stopped).delete()
        for pk in stopped:
            self.pacer.forget(pk)
            self.draining_since.pop(pk, None)
            self.known.discard(pk)
        return True

