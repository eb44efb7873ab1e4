"""The gateway's own figures per deployment, as the controllers read them: requests in
flight, requests queued (and the estimated wait of the queue), and requests answered and
failed (counters, as totals since the process started).

Every process takes its figures from its Prometheus registry (serving/metrics.py, what
/metrics serves): nothing is added to the request path. In one process (the embedded
default) the collector reads them there. With REDIS_URL set each gateway process also
publishes a snapshot every PUBLISH_SECONDS under its own key,
`fleetplane:gateway-figures:<process>`, which expires after TTL_SECONDS (so a dead
process's figures vanish); the key is written when the figures changed or when its expiry
needs renewing. The controllers sum the live snapshots of every process
(`FleetFigures`): gauges are added up; counters are followed per process and only their
increases are added to the fleet's totals, so a process that dies, or a new one that
starts from zero, never makes a total go down (which would read as a negative rate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.demand import PROCESS
from serving.wakeup import until_beat

logger = logging.getLogger(__name__)

REDIS_PREFIX = "fleetplane:gateway-figures:"
PUBLISH_SECONDS = 1.0
TTL_SECONDS = 3 * PUBLISH_SECONDS
#: How long the reader remembers the counters of a process whose key has gone: one that
#: comes back within it (a late renewal, a Redis blip) is counted from where it was.
FORGET_SECONDS = 60.0
#: When this process began counting (its counters are totals since then).
STARTED = time.time()


@dataclass
class Snapshot:
    """One process's figures (or the fleet's): per deployment, answered and failed
    (non-2xx) requests as totals, in flight and queued requests, the queue's wait."""

    requests: dict[str, tuple[float, float]] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)
    queued: dict[str, float] = field(default_factory=dict)
    queue_wait: dict[str, float] = field(default_factory=dict)
    started: float = 0.0

    def to_json(self) -> str:
        """The text stored in Redis (stable: equal figures give equal text)."""
        return json.dumps({"started": self.started,
                           "requests": {k: list(v) for k, v in self.requests.items()},
                           "in_flight": self.in_flight, "queued": self.queued,
                           "queue_wait": self.queue_wait}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Snapshot:
        """A snapshot `to_json` wrote; ValueError (or KeyError, TypeError) if malformed."""
        raw = json.loads(text)
        return cls(requests={str(k): (float(v[0]), float(v[1]))
                             for k, v in raw["requests"].items()},
                   in_flight=numbers(raw["in_flight"]), queued=numbers(raw["queued"]),
                   queue_wait=numbers(raw["queue_wait"]), started=float(raw["started"]))


def numbers(raw: dict[str, Any]) -> dict[str, float]:
    return {str(key): float(value) for key, value in raw.items()}


def local_snapshot() -> Snapshot:
    """This process's figures, from its Prometheus registry."""
    from serving import metrics

    out = Snapshot(started=STARTED)
    totals: dict[str, list[float]] = {}
    # These four families only: collecting the whole registry walks every histogram.
    for family in (*metrics.REQUESTS.collect(), *metrics.IN_FLIGHT.collect(),
                   *metrics.QUEUED.collect(), *metrics.QUEUE_ESTIMATE.collect()):
        for sample in family.samples:
            deployment = sample.labels.get("deployment")
            if deployment is None:
                continue
            if sample.name == "fleetplane_gateway_requests_total":
                entry = totals.setdefault(deployment, [0.0, 0.0])
                entry[0] += sample.value
                if not sample.labels["status"].startswith("2"):
                    entry[1] += sample.value
            elif sample.name == "fleetplane_gateway_in_flight_requests":
                out.in_flight[deployment] = out.in_flight.get(deployment, 0.0) + sample.value
            elif sample.name == "fleetplane_gateway_queued_requests":
                out.queued[deployment] = out.queued.get(deployment, 0.0) + sample.value
            elif sample.name == "fleetplane_gateway_queue_estimated_wait_seconds":
                out.queue_wait[deployment] = sample.value
    out.requests = {deployment: (count, errors) for deployment, (count, errors)
                    in totals.items()}
    return out


# --- publishing (each gateway process) ----------------------------------------------------


class Publisher:
    """Writes one process's snapshot under its own key, when it changed or when the key's
    expiry needs renewing."""

    def __init__(self, process: str = PROCESS, ttl: float = TTL_SECONDS) -> None:
        self.key = REDIS_PREFIX + process
        self.ttl = ttl
        self.text = ""
        self.written = -math.inf

    async def publish(self, connection: Any, snapshot: Snapshot, now: float) -> bool:
        """Write the snapshot if needed (`now`: a monotonic clock); True if written."""
        text = snapshot.to_json()
        if text == self.text and now - self.written < self.ttl / 2:
            return False
        await connection.set(self.key, text, px=max(1, round(self.ttl * 1000)))
        self.text, self.written = text, now
        return True

    def forget(self) -> None:
        """The next snapshot is written whatever it holds (a new connection, a new store)."""
        self.text, self.written = "", -math.inf


async def publish_forever(client: Callable[[], Any],
                          interval: float = PUBLISH_SECONDS) -> None:
    """While the event loop has a Redis client (`client()`: the loop's own, None without
    REDIS_URL), this process's snapshot to Redis every `interval` seconds. Never raises:
    a failure is logged once, and retried until it works again."""
    publisher = Publisher(ttl=3 * interval)
    connection: Any = None
    failing = False
    while True:
        try:
            current = client()
            if current is not connection:  # another REDIS_URL: everything written again
                connection = current
                publisher.forget()
            if connection is not None:
                await publisher.publish(connection, local_snapshot(), time.monotonic())
            failing = False
        except Exception:
            if not failing:
                logger.warning("could not publish the gateway's figures to Redis; retrying "
                               "every %.1f s", interval, exc_info=True)
            failing = True
            publisher.forget()
        await asyncio.sleep(until_beat(interval))


# --- reading (the controllers) -------------------------------------------------------------


def fetch_snapshots(connection: Any, skip: str = PROCESS) -> dict[str, Snapshot]:
    """The live snapshots in Redis by process, but `skip`'s (this process's own, read
    from its registry instead). A malformed entry is logged and left out."""
    keys = [key for key in connection.scan_iter(match=REDIS_PREFIX + "*", count=200)
            if key.decode().removeprefix(REDIS_PREFIX) != skip]
    values = connection.mget(keys) if keys else []
    out: dict[str, Snapshot] = {}
    for key, value in zip(keys, values, strict=True):
        if value is None:  # expired between the scan and the read
            continue
        process = key.decode().removeprefix(REDIS_PREFIX)
        try:
            out[process] = Snapshot.from_json(value)
        except (ValueError, KeyError, TypeError, IndexError):
            logger.warning("ignored malformed gateway figures of process %s", process)
    return out


class FleetFigures:
    """The figures of every gateway process summed: this process's from its registry,
    with REDIS_URL the others' from their snapshots in Redis."""

    def __init__(self) -> None:
        #: process -> (its request totals when last seen, when that was)
        self.seen: dict[str, tuple[dict[str, tuple[float, float]], float]] = {}
        #: deployment -> [answered, failed] over the fleet: only ever increases
        self.totals: dict[str, list[float]] = {}
        self.last_read: float | None = None
        self.remote: dict[str, Snapshot] = {}
        self.remote_at = -math.inf
        self.failing = False
        self.connection: Any = None
        self.url = ""
        self.fetching: asyncio.Future[dict[str, Snapshot]] | None = None

    def read(self, redis_url: str | None, at: float) -> Snapshot:
        """The fleet's figures at `at` (epoch seconds); `requests` holds the fleet's
        totals, which never decrease."""
        snapshots = {PROCESS: local_snapshot()}
        if redis_url:
            snapshots.update(self.others(redis_url))
        return self.add_up(snapshots, at)

    def add_up(self, snapshots: dict[str, Snapshot], at: float) -> Snapshot:
        """Sum the gauges; add each process's counter increases since the last read to
        the fleet's totals. A process seen for the first time adds what it counted only
        if it started after the last read (else its totals are where it is taken up)."""
        out = Snapshot(started=min((s.started for s in snapshots.values()), default=0.0))
        for process, snapshot in snapshots.items():
            known = self.seen.get(process)
            new = known is None and self.last_read is not None and \
                snapshot.started > self.last_read
            before = known[0] if known is not None else {}
            for deployment, (count, errors) in snapshot.requests.items():
                entry = self.totals.setdefault(deployment, [0.0, 0.0])
                if known is None and not new:
                    continue
                was = before.get(deployment, (0.0, 0.0))
                # A counter never goes down within one process; if it did, what it shows
                # now is new.
                entry[0] += count - was[0] if count >= was[0] else count
                entry[1] += errors - was[1] if errors >= was[1] else errors
            self.seen[process] = (dict(snapshot.requests), at)
            add_gauges(out, snapshot)
        for process in [p for p, (_, when) in self.seen.items() if at - when > FORGET_SECONDS]:
            del self.seen[process]
        self.last_read = at
        out.requests = {deployment: (count, errors) for deployment, (count, errors)
                        in self.totals.items()}
        return out

    def others(self, redis_url: str) -> dict[str, Snapshot]:
        """Other processes' snapshots. Inside an event loop the read runs in the loop's
        executor and the last one finished is used (the loop never waits on Redis); a
        failed read keeps the last snapshots until they would have expired."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to keep free: read now
            self.take(lambda: self.fetch(redis_url))
            return self.remote
        if self.fetching is not None and self.fetching.get_loop() is not loop:
            self.fetching = None  # begun in a loop that has gone
        if self.fetching is not None and self.fetching.done():
            fetched, self.fetching = self.fetching, None
            self.take(fetched.result)
        if self.fetching is None:
            self.fetching = loop.run_in_executor(None, self.fetch, redis_url)
        return self.remote

    def take(self, read: Callable[[], dict[str, Snapshot]]) -> None:
        try:
            self.remote = read()
            self.remote_at = time.monotonic()
            self.failing = False
        except Exception as exc:
            if not self.failing:  # once, until a read works again
                logger.warning("could not read the gateway figures from Redis: %s", exc)
            self.failing = True
            if time.monotonic() - self.remote_at > TTL_SECONDS:
                self.remote = {}

    def fetch(self, redis_url: str) -> dict[str, Snapshot]:
        import redis

        if self.connection is None or self.url != redis_url:
            self.connection = redis.Redis.from_url(redis_url, socket_timeout=2,
                                                   socket_connect_timeout=2)
            self.url = redis_url
        return fetch_snapshots(self.connection)


def add_gauges(out: Snapshot, snapshot: Snapshot) -> None:
    """In flight and queued requests add up; of the queue's estimated waits, the longest."""
    for deployment, value in snapshot.in_flight.items():
        out.in_flight[deployment] = out.in_flight.get(deployment, 0.0) + value
    for deployment, value in snapshot.queued.items():
        out.queued[deployment] = out.queued.get(deployment, 0.0) + value
    for deployment, value in snapshot.queue_wait.items():
        out.queue_wait[deployment] = max(out.queue_wait.get(deployment, value), value)
