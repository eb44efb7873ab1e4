"""The load watcher, one per event loop: every GATEWAY_LOAD_SCRAPE_SECONDS it scrapes
the queue (vLLM's running + waiting) of each routed replica that shares its pool with
another, for least-load routing (and of each one sitting out, to take it back in), follows the
route table and key changes through Redis when the controller runs elsewhere, gives the
priority queue the slots of the replicas that came or went, and cuts off the streams of
keys revoked meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time

from django.conf import settings

from serving import metrics
from serving.engine_metrics import requests_in_system
from serving.gateway.resources import Resources
from serving.keys import authenticate_hash, follow_key_changes, forget_cached_keys
from serving.routes import REDIS_KEY, RouteReplica, replica_auth, routes
from serving.upstream import UpstreamError
from serving.wakeup import until_beat

logger = logging.getLogger("serving.gateway")


async def watch_load(resources: Resources) -> None:
    """Run the watcher's pass for the life of the event loop."""
    redis_away = False
    while True:
        try:
            resources.follow_settings()
            redis_away = await follow_redis(resources, redis_away)
            await scrape_load(resources)
            refresh_capacity(resources)
        except Exception:
            logger.exception("load watcher failed; trying again")
        try:
            await end_streams_of_revoked_keys(resources)
        except Exception:
            logger.exception("could not check the keys of running streams")
        await asyncio.sleep(until_beat(settings.GATEWAY_LOAD_SCRAPE_SECONDS))


async def follow_redis(resources: Resources, away: bool) -> bool:
    """Take key changes and (without a controller here) the route table from Redis;
    returns whether Redis is out of reach. While it is, this process serves with the
    table and keys it knows (keys are still read again from the database within
    KEY_CACHE_SECONDS). When it answers again every cached key is forgotten, since a
    change told meanwhile was lost, and the route table is read: both within one
    GATEWAY_LOAD_SCRAPE_SECONDS."""
    commands = resources.commands
    if commands is None:
        return False
    try:
        if routes.publishes_locally:
            await follow_key_changes(commands)
        else:  # the key version and the route table in one round trip
            text, = await follow_key_changes(commands, REDIS_KEY)
            if text:
                routes.load_json(text.decode() if isinstance(text, bytes) else str(text))
    except Exception as exc:
        if not away:
            logger.warning("Redis is out of reach (%s): serving with the route table and "
                           "keys known; keys with rate limits get 503 until it answers",
                           exc)
        return True
    if away:
        forget_cached_keys()
        logger.warning("Redis answers again: key changes and the route table are followed "
                       "again")
    return False


async def end_streams_of_revoked_keys(resources: Resources) -> None:
    """Cut off the running streams of keys revoked or expired since they began (seen
    through the key cache: at once in this process, within GATEWAY_LOAD_SCRAPE_SECONDS
    in others with Redis, within KEY_CACHE_SECONDS without)."""
    for key_hash in list(resources.streams.by_key):
        if await authenticate_hash(key_hash) is None:
            resources.streams.cut(key_hash)


def refresh_capacity(resources: Resources) -> None:
    """Replicas came or went, or one began or ended sitting out: waiting requests take
    the new slots. Each deployment's estimated queue wait is published too. Done for the
    whole fleet only when the route table or the replicas sitting out changed; otherwise
    only the estimates of deployments that have requests waiting, or had at the last
    look, are set again (a thousand idle deployments cost a comparison a second)."""
    now = time.monotonic()
    router, admission = resources.router, resources.admission
    table = routes.table
    sitting_out = frozenset(name for name, state in router.states.items()
                            if state.unhealthy_until > now)
    seen = resources.capacity_seen
    if seen is not None and seen[0] is table and seen[1] == sitting_out:
        estimate = admission.deployments_waiting() | resources.estimated
    else:
        for deployment in table.deployments():
            for pool, replicas in deployment.context_pools().items():
                # Healthy replicas only, as at admission: no slots on one sitting out.
                healthy = sum(1 for r in replicas if r.name not in sitting_out)
                admission.set_capacity(f"{deployment.deployment}|{pool}",
                                       healthy * deployment.replica_concurrency)
        resources.capacity_seen = (table, sitting_out)
        estimate = {deployment.deployment for deployment in table.deployments()}
    estimated: set[str] = set()
    for name in estimate:
        wait = round(admission.estimated_wait(name), 3)
        metrics.child(metrics.QUEUE_ESTIMATE, name).set(wait)
        if wait:
            estimated.add(name)
    resources.estimated = estimated


def replicas_to_scrape(resources: Resources) -> tuple[set[str], dict[str, RouteReplica]]:
    """Every routed replica's name, and the replicas whose queue is worth reading: those
    that share a pool with another (their load chooses between them) and those sitting
    out after a failure (an answer takes them back in). A replica alone in its pool is
    taken whatever its load, so a fleet of single-replica deployments costs no scrape."""
    present: set[str] = set()
    wanted: dict[str, RouteReplica] = {}
    states = resources.router.states
    for pool in routes.table.pools.values():
        shared = len(pool.replicas) > 1
        for replica in pool.replicas:
            present.add(replica.name)
            state = states.get(replica.name)
            if shared or (state is not None and state.failures):
                wanted[replica.name] = replica
    return present, wanted


async def scrape_load(resources: Resources) -> None:
    """The running + waiting requests of the replicas whose load is read (see
    `replicas_to_scrape`), into the router's state."""
    present, replicas = replicas_to_scrape(resources)
    router = resources.router
    router.forget_missing(present)
    for name in present.difference(replicas):  # alone in its pool: no stale figure kept
        state = router.states.get(name)
        if state is not None:
            state.scraped = 0
    if not replicas:
        return
    client = resources.scrapes

    async def one(replica: RouteReplica) -> None:
        state = router.state(replica.name)
        own_before = state.in_flight
        try:
            async with asyncio.timeout(2):
                text = await client.get_text(replica.url, "/metrics", replica_auth(replica))
        except (UpstreamError, TimeoutError):
            return
        # The engine's count holds this process's own requests, which `in_flight` counts
        # already and keeps current: only the rest (other gateway processes', anything
        # sent to the engine directly) is kept, so a scrape that caught one of our own
        # requests running does not leave the replica counted busy until the next scrape.
        own = max(own_before, state.in_flight)
        state.scraped = max(0, int(requests_in_system(text) or 0) - own)
        if state.failures:
            # Active health: a replica that answers again is taken back in.
            router.succeeded(replica.name)

    await asyncio.gather(*(one(r) for r in replicas.values()))
