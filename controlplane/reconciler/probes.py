"""When each replica's health is probed: paced per endpoint, in memory only.

A ready replica is probed every HEALTH_CHECK_SECONDS. An endpoint something else runs
that stopped answering is probed on a backoff: HEALTH_CHECK_SECONDS after the first
failed probe, then twice as long after each further one, up to
HEALTH_BACKOFF_MAX_SECONDS, so a fleet of endpoints that keep refusing costs a probe per
endpoint per minute, not per pass; it is routed to again within that bound (and one warm-up)
of answering. Every other replica (starting, loading, warming) is probed on every pass.

Nothing here needs to outlive the process: a restart probes every replica once and
paces them again from there.
"""

from __future__ import annotations

import time

from django.conf import settings

from controlplane.models import Replica

NOT_PACED = 0.0


class ProbePacer:
    """The last probe and the failed probes in a row of each replica (by pk)."""

    def __init__(self) -> None:
        #: When each replica was last probed (monotonic seconds).
        self.last_probe: dict[int, float] = {}
        #: Probes in a row that found an endpoint unreachable.
        self.failures: dict[int, int] = {}

    def interval(self, replica: Replica, creates_replicas: bool) -> float:
        """Seconds between this replica's probes; 0 for one probed on every pass."""
        if replica.phase == Replica.Phase.READY:
            return settings.HEALTH_CHECK_SECONDS
        if replica.last_error and not creates_replicas:  # an endpoint that stopped answering
            failed = max(self.failures.get(replica.pk, 1), 1)
            backoff = settings.HEALTH_CHECK_SECONDS * 2 ** min(failed - 1, 16)
            return min(backoff, max(settings.HEALTH_BACKOFF_MAX_SECONDS,
                                    settings.HEALTH_CHECK_SECONDS))
        return NOT_PACED

    def next_at(self, replica: Replica, creates_replicas: bool) -> float:
        """When the replica's next probe is due (monotonic seconds)."""
        interval = self.interval(replica, creates_replicas)
        last = self.last_probe.get(replica.pk)
        if interval == NOT_PACED or last is None:  # never probed by this process: now
            return 0.0
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
