"""When each replica's health is probed: paced per endpoint, in memory only.

A ready replica is probed every HEALTH_CHECK_SECONDS. An endpoint something else runs
that stopped answering is probed on a backoff: HEALTH_CHECK_SECONDS after the first
failed probe, then twice as long after each further one, up to
HEALTH_BACKOFF_MAX_SECONDS, so a fleet of endpoints that keep refusing costs a probe per
endpoint per minute, not per pass; it is routed to again within that bound (and one warm-up)
of answering. Every other replica (starting, loading, warming) is probed on every pass.
A new process probes the ready and unreachable replicas it inherits within their first
interval, spread over it.

Nothing here needs to outlive the process. A new process takes up an inherited
endpoint's backoff where the failures so far would have brought it (from how long ago it
last answered, or was started: `inherited_failures`), so a restart of a control plane
whose fleet holds hundreds of dead endpoints does not probe them all every few seconds
for its first minute.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import cast

from django.conf import settings
from django.utils import timezone

from controlplane.backends.base import Observation, ReplicaBackend, backend_for
from controlplane.models import Deployment, Replica
from serving.sqlite_commits import eventless_transaction

# Probes run side by side (a probe that times out costs one timeout, not one per replica).
PROBE_THREADS = 32
# The longest a pass waits for the probes it begins (a probe of an endpoint that answers
# takes milliseconds). A probe still running then (an endpoint that accepts connections
# and answers nothing takes its whole timeout to fail) goes on, and the first pass after
# it ends takes its answer, without waiting for it meanwhile: a fleet of hung endpoints
# holds up neither the passes nor the routing of the endpoints that answer.
PROBE_WAIT_SECONDS = 0.5
# A probe's answer not taken up by a pass within this long after it came is not gone by
# (a replica deleted while its probe ran leaves one behind); a new probe is begun instead.
# A probe still waiting for a thread or running is never begun again beside itself.
STALE_PROBE_SECONDS = 15.0

NOT_PACED = 0.0


class ProbePacer:
    """The last probe and the failed probes in a row of each replica (by pk)."""

    def __init__(self) -> None:
        #: When each replica was last probed (monotonic seconds).
        self.last_probe: dict[int, float] = {}
        #: Probes in a row that found an endpoint unreachable.
        self.failures: dict[int, int] = {}
        # Kept for the process: starting threads anew each pass cost more than the probes.
        self.pool = ThreadPoolExecutor(max_workers=PROBE_THREADS,
                                       thread_name_prefix="probe")
        # Endpoints out of routing are probed on threads of their own, so hundreds of
        # endpoints that hang cannot queue the probes of those that answer behind them.
        self.down_pool = ThreadPoolExecutor(max_workers=PROBE_THREADS,
                                            thread_name_prefix="probe-down")
        #: Probes begun and not yet taken up by a pass, by what they probe (`probe_key`).
        self.running: dict[Hashable, Future[Observation]] = {}
        #: When each of those ended (monotonic seconds), set from the probe's thread.
        self.ended_at: dict[Hashable, float] = {}

    def interval(self, replica: Replica, creates_replicas: bool) -> float:
        """Seconds between this replica's probes; 0 for one probed on every pass."""
        if replica.phase == Replica.Phase.READY:
            return settings.HEALTH_CHECK_SECONDS
        if replica.last_error and not creates_replicas:  # an endpoint that stopped answering
            failed = self.failures.get(replica.pk)
            if failed is None:
                failed = 1
                if replica.pk not in self.last_probe:  # failing since before this process
                    failed = self.failures[replica.pk] = inherited_failures(replica)
            failed = max(failed, 1)
            backoff = settings.HEALTH_CHECK_SECONDS * 2 ** min(failed - 1, 16)
            return min(backoff, max(settings.HEALTH_BACKOFF_MAX_SECONDS,
                                    settings.HEALTH_CHECK_SECONDS))
        return NOT_PACED

    def next_at(self, replica: Replica, creates_replicas: bool) -> float:
        """When the replica's next probe is due (monotonic seconds)."""
        interval = self.interval(replica, creates_replicas)
        if interval == NOT_PACED:
            return 0.0
        last = self.last_probe.get(replica.pk)
        if last is None:
            # Never probed by this process: as if probed at a random moment of the last
            # interval, so a new process's first probes of a large fleet are spread over
            # one interval instead of all crowding its first pass (and its start).
            last = self.last_probe[replica.pk] = time.monotonic() - random.uniform(
                0.0, interval)
        return last + interval

    def due(self, replica: Replica, creates_replicas: bool, now: float) -> bool:
        """Whether the replica is to be probed in a pass at `now`."""
        return self.next_at(replica, creates_replicas) <= now

    def probed(self, replica: Replica, answered: bool) -> None:
        """Record a probe and whether it was answered. The backoff counts the failures of
        an endpoint out of routing only (a ready one is probed at its interval)."""
        self.last_probe[replica.pk] = time.monotonic()
        if answered or replica.phase == Replica.Phase.READY:
            self.failures.pop(replica.pk, None)
        else:
            self.failures[replica.pk] = self.failures.get(replica.pk, 0) + 1

    def forget(self, pk: int) -> None:
        """The replica is gone."""
        self.last_probe.pop(pk, None)
        self.failures.pop(pk, None)
        self.running.pop(("replica", pk), None)
        self.ended_at.pop(("replica", pk), None)

    def probe(self, items: list[tuple[Deployment, Replica]]) -> dict[int, Observation]:
        """Probe these replicas side by side, waiting at most PROBE_WAIT_SECONDS for the
        probes begun here; the observation of each probe that ended (here or since an
        earlier call), by pk. A replica whose probe is still running is left out: its
        probe goes on (none is begun beside it), and a later call takes its answer."""
        if not items:
            return {}
        now = time.monotonic()
        begun: list[tuple[Replica, Hashable, Future[Observation]]] = []
        new: list[Future[Observation]] = []
        for deployment, replica in items:
            key = probe_key(deployment, replica)
            future = self.running.get(key)
            if future is not None and future.done() and \
                    now - self.ended_at.get(key, now) > STALE_PROBE_SECONDS:
                future = None  # an answer nobody took up in time: too old to go by
            if future is None:
                down = replica.phase != Replica.Phase.READY and bool(replica.last_error)
                future = (self.down_pool if down else self.pool).submit(
                    _backend(deployment).observe, deployment, replica, probe_health=True)
                self.running[key] = future
                self.ended_at.pop(key, None)
                future.add_done_callback(self._ended(key))
                new.append(future)
            begun.append((replica, key, future))
        if new:
            wait(new, timeout=PROBE_WAIT_SECONDS)
        observations = {}
        for replica, key, future in begun:
            if not future.done():
                continue
            if self.running.get(key) is future:
                del self.running[key]
                self.ended_at.pop(key, None)
            observation = future.result()  # a backend's own failure fails the pass
            observations[replica.pk] = observation
            self.probed(replica, observation.alive and observation.healthy)
        return observations

    def close(self) -> None:
        """The controllers stop: probes waiting for a thread are dropped, so the process
        does not wait at its exit for a queue of probes of endpoints that hang (those
        running end within their timeout)."""
        for pool in (self.pool, self.down_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.running.clear()

    def _ended(self, key: Hashable) -> Callable[[Future[Observation]], None]:
        def ended(future: Future[Observation]) -> None:
            if self.running.get(key) is future:
                self.ended_at[key] = time.monotonic()
        return ended

    def probe_settled(self, settled: list[tuple[Deployment, list[Replica]]]
                      ) -> tuple[set[int], dict[int, Observation]]:
        """Probe the due replicas of settled deployments from what the last pass read of
        them, without reading them again: an endpoint still answering (its probe recorded
        in one write) or still failing the same way changes nothing. Returns the
        deployments a probe found changed, to be read and reconciled, with those probes'
        observations."""
        now = time.monotonic()
        due = [(deployment, replica) for deployment, replicas in settled
               for replica in replicas
               if self.due(replica, _backend(deployment).creates_replicas, now)]
        observations = self.probe(due)
        due = [(deployment, replica) for deployment, replica in due
               if replica.pk in observations]  # the probes still running: a later pass's
        changed: set[int] = set()
        healthy: list[Replica] = []
        record = timedelta(seconds=settings.HEALTH_RECORD_SECONDS)
        wall = timezone.now()
        for deployment, replica in due:
            seen = observations[replica.pk]
            answered = seen.alive and seen.healthy
            if replica.phase == Replica.Phase.READY and answered:
                if replica.last_health_at is None or wall - replica.last_health_at > record:
                    healthy.append(replica)
            elif not (replica.phase == Replica.Phase.LOADING and not answered
                      and seen.message == replica.last_error):
                changed.add(deployment.pk)
        if healthy:
            with eventless_transaction():  # no event: the change watch stays quiet
                Replica.objects.filter(pk__in=[r.pk for r in healthy]).update(
                    last_health_at=wall)
            for replica in healthy:
                replica.last_health_at = wall
        return changed, {replica.pk: observations[replica.pk] for deployment, replica in due
                         if deployment.pk in changed}


def probe_key(deployment: Deployment, replica: Replica) -> Hashable:
    """What a probe of the replica asks: for an endpoint something else runs, its URL and
    key (every deployment on one endpoint gets one probe and its answer, so a thousand
    deployments on one endpoint that hangs hold one probe thread, not all of them); for
    any other replica, itself."""
    target = getattr(_backend(deployment), "probe_target", None)
    return target() if target is not None else ("replica", replica.pk)


def inherited_failures(replica: Replica) -> int:
    """The failed probes in a row that would have brought the backoff to where it is for
    an endpoint failing since it last answered (or since it was started, if it never
    did): after k failures in a row the endpoint has failed for about
    HEALTH_CHECK_SECONDS * (2^(k-1) - 1), and the next interval is
    HEALTH_CHECK_SECONDS * 2^(k-1), about as long again."""
    base = settings.HEALTH_CHECK_SECONDS
    since = replica.last_health_at or replica.started_at or replica.created_at
    if base <= 0 or since is None:
        return 1
    failing = max((timezone.now() - since).total_seconds(), 0.0)
    return 1 + int(math.log2(1 + failing / base))


def _backend(deployment: Deployment) -> ReplicaBackend:
    return cast(ReplicaBackend, backend_for(deployment.backend))
