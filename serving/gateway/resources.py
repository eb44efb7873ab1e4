"""What the gateway's requests share on one event loop, built once when the loop serves
its first request: the upstream connection pools, the usage writer, the priority queue,
the rate limiter, the loop's Redis client and the loop's background tasks.

Connections, the usage writer and an asyncio Redis client belong to the loop they were
made in (tests run several loops one after the other), so a new loop gets new ones. The
rate limiter and the Redis client follow REDIS_URL, read per request so a changed setting
takes effect: budgets are shared through Redis when it is configured, else kept here.

The tokens an answer owes its key's budgets once it has ended (`owe`) are charged at
once to a budget kept here; with Redis they are summed per bucket and sent together,
one script call for every answer that ended within CHARGE_BATCH_SECONDS, not one each
(the limits are per minute: a charge a few milliseconds later changes nothing a client
can see). What is owed when the server stops is sent before it exits (`settle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from serving.admission import Admission
from serving.hot_settings import hot
from serving.ratelimit import Limit, Limiter, MemoryLimiter, RedisLimiter
from serving.redis_clients import for_event_loop
from serving.router import Router
from serving.upstream import ConnectionPool
from serving.usage import UsageWriter

if TYPE_CHECKING:
    from serving.redis_script import Commands

logger = logging.getLogger("serving.gateway")
# How long the tokens owed to budgets in Redis are summed before they are sent, and the
# most buckets one charge carries (the limiter bounds each script call again: see
# serving/ratelimit.py's BATCH_BUCKETS).
CHARGE_BATCH_SECONDS = 0.02
CHARGE_BATCH_BUCKETS = 64


class LiveStreams:
    """The relays of the running streams, by their key's hash: a key revoked meanwhile
    has its streams cut off."""

    def __init__(self) -> None:
        self.by_key: dict[str, set[asyncio.Future[None]]] = {}
        self.cut_off: set[asyncio.Future[None]] = set()

    def add(self, key_hash: str, pump: asyncio.Future[None]) -> None:
        """Follow a stream's relay."""
        self.by_key.setdefault(key_hash, set()).add(pump)

    def discard(self, key_hash: str, pump: asyncio.Future[None]) -> None:
        """Forget a relay that ended."""
        mine = self.by_key.get(key_hash)
        if mine is not None:
            mine.discard(pump)
            if not mine:
                del self.by_key[key_hash]

    def cut(self, key_hash: str) -> None:
        """End every running stream of this key."""
        for pump in self.by_key.pop(key_hash, ()):
            if not pump.done():
                self.cut_off.add(pump)
                pump.cancel()

    def was_cut(self, pump: asyncio.Future[None]) -> bool:
        """Whether this relay ended because its key was revoked (asked once)."""
        if pump in self.cut_off:
            self.cut_off.discard(pump)
            return True
        return False


def warm_seconds() -> float:
    """How long after its last request a replica's connections are kept open."""
    return float(hot.GATEWAY_UPSTREAM_WARM_SECONDS)


class Resources:
    """One event loop's share of the gateway, handed to every stage with the call."""

    def __init__(self, loop: asyncio.AbstractEventLoop, router: Router,
                 streams: LiveStreams) -> None:
        self.loop = loop
        self.router = router  # the process's: replica health outlives a loop
        self.streams = streams
        self.connections = ConnectionPool(warm_seconds)
        # The load watcher's scrapes of the replicas' /metrics: apart, so that they do not
        # keep the replicas' connections warm (serving/upstream/pool.py).
        self.scrapes = ConnectionPool()
        self.usage = UsageWriter()
        self.admission = Admission()
        self.redis_url = ""
        self.redis: Any = None  # the loop's asyncio Redis client, while REDIS_URL is set
        # The background work's own (serving/redis_script.py), while REDIS_URL is set.
        self.commands: Commands | None = None
        self.limiter: Limiter = MemoryLimiter()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.background: dict[str, asyncio.Task[None]] = {}
        self.background_running = False  # every one of them started and none ended since
        self.work = background_work()
        # What the load watcher last gave the queue slots from (the route table and the
        # replicas sitting out), and the deployments whose estimated wait it last set
        # above 0 (serving/gateway/watcher.py, refresh_capacity).
        self.capacity_seen: tuple[Any, frozenset[str]] | None = None
        self.estimated: set[str] = set()
        # Tokens owed to budgets in Redis, summed per bucket until the timer sends them.
        self.owed: dict[str, Limit] = {}
        self.owed_timer: asyncio.TimerHandle | None = None

    def follow_settings(self) -> None:
        """Take a changed REDIS_URL: a new client, and budgets kept where it says."""
        url = hot.REDIS_URL or ""
        if url == self.redis_url:
            return
        old, old_limiter, self.redis_url = self.redis, self.limiter, url
        old_commands = self.commands
        self.redis = for_event_loop(url) if url else None
        self.commands = None
        if url:
            from serving.redis_script import Commands  # (redis and hiredis only then)

            self.commands = Commands(url)
        self.limiter = RedisLimiter(url) if url else MemoryLimiter()
        if old is not None:
            self.spawn(old.aclose())
        if old_commands is not None:
            self.spawn(old_commands.close())
        if isinstance(old_limiter, RedisLimiter):
            self.spawn(old_limiter.close())

    def keep_background(self) -> None:
        """Start the loop's background tasks, once (and again should one have ended).

        The place for a per-loop background task is `background_work()`: each entry is
        called with these resources and runs for the life of the loop."""
        if self.background_running:  # every request asks: one look when nothing ended
            return
        for name, work in self.work.items():
            task = self.background.get(name)
            if task is None or task.done():
                self.background[name] = task = self.loop.create_task(work(self))
                task.add_done_callback(self.background_ended)
        self.background_running = True

    def background_ended(self, _task: asyncio.Task[None]) -> None:
        """A background task ended (it should not): the next request starts it again."""
        self.background_running = False

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` beside the request, holding on to it until it ends."""
        task = self.loop.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def owe(self, charges: list[Limit]) -> None:
        """Charge the tokens an ended answer owes (more, or some given back): at once to
        a budget kept here, within CHARGE_BATCH_SECONDS with others to one in Redis."""
        limiter = self.limiter
        if isinstance(limiter, MemoryLimiter):  # a plain call: no task
            limiter.charge_now(charges)
            return
        owed = self.owed
        for limit in charges:
            known = owed.get(limit.bucket)
            owed[limit.bucket] = limit if known is None else limit._replace(
                cost=known.cost + limit.cost)
        if self.owed_timer is None:
            self.owed_timer = self.loop.call_later(CHARGE_BATCH_SECONDS, self.send_owed)

    def send_owed(self) -> None:
        """Send the summed charges, CHARGE_BATCH_BUCKETS buckets a charge."""
        if self.owed_timer is not None:
            self.owed_timer.cancel()
            self.owed_timer = None
        owed, self.owed = [limit for limit in self.owed.values() if limit.cost], {}
        for start in range(0, len(owed), CHARGE_BATCH_BUCKETS):
            self.spawn(self.charge(owed[start:start + CHARGE_BATCH_BUCKETS]))

    async def settle(self, timeout: float) -> None:
        """Send what is owed now and wait (at most `timeout` seconds) for every charge,
        refund and other work spawned beside the requests: the server is stopping."""
        self.send_owed()
        if self.tasks:
            _done, pending = await asyncio.wait(set(self.tasks), timeout=timeout)
            if pending:
                logger.warning("%d rate-limit charges or other gateway tasks did not end "
                               "within %.0f s of stopping", len(pending), timeout)

    async def charge(self, charges: list[Limit]) -> None:
        """Charge tokens used to the rate limits (logged, not raised, on failure)."""
        try:
            await self.limiter.charge(charges)
        except Exception:
            logger.exception("could not charge tokens to the rate limits")

    async def refund(self, limits: list[Limit]) -> None:
        """Give back the budget of a request no replica answered."""
        try:
            await self.limiter.refund(limits)
        except Exception:
            logger.exception("could not give back a refused request's budget")


BackgroundWork = Callable[[Resources], Coroutine[Any, Any, None]]


def background_work() -> dict[str, BackgroundWork]:
    """The tasks each event loop runs for its life, by name."""
    from serving import figures
    from serving.gateway.watcher import watch_load

    def publish_figures(resources: Resources) -> Coroutine[Any, Any, None]:
        return figures.publish_forever(lambda: resources.commands)

    # The figures the controllers sum over every gateway process (serving/figures.py).
    return {"load watcher": watch_load, "figures": publish_figures}
