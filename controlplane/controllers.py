"""Runs the controllers: a reconcile pass every RECONCILE_INTERVAL_SECONDS, or at once when
a change asks for one (controlplane/wakeups.py); a pass visits only what has work to do
unless something may have changed (controlplane/reconciler/schedule.py), and one with
nothing to do at all is skipped where that can be told without a query (SQLite; with
REDIS_URL, one pass every ROUTE_TABLE_LOOK_SECONDS still looks that Redis holds the
route table, which a Redis restarted without persistence has lost). Passes
run in a worker thread so the event loop never blocks. A new process serves the route
table the last pass left in the database before its own first pass ends.

The collector is reached through its module (`collector.run_collector`), so that it is
looked up when the controllers start."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, reset_queries

from controlplane import collector, liveness
from controlplane.audit_log import run_event_pruning
from controlplane.autoscaler.runner import Autoscaler
from controlplane.leader import LeaseElection
from controlplane.outages import DatabaseOutage
from controlplane.reconciler import Reconciler
from controlplane.routing import publish_routes
from controlplane.wakeups import figures_collected, reconcile_requested, request_reconcile
from serving.demand import demand
from serving.routes import routes
from serving.wakeup import until_beat, wait_any

__all__ = ["publish_decisions", "request_reconcile", "run_autoscaler", "run_controllers"]

logger = logging.getLogger(__name__)
# With REDIS_URL, how often a pass is run when it would have nothing else to do: to put
# the route table back in Redis should it have lost it (one EXISTS when it has not).
ROUTE_TABLE_LOOK_SECONDS = 5.0


def _end_of_work() -> None:
    """What Django does at the end of a request, for the worker threads' passes: stale
    connections closed, and with DEBUG on, the thread's query log emptied (Django keeps
    up to 9,000 queries per connection, and only requests empty it: the threads of the
    loop's default executor, shared by these passes and the usage writer, would keep
    tens of MiB; bench/soak.py saw it as memory growth)."""
    close_old_connections()
    reset_queries()


def _one_pass(reconciler: Reconciler, requested: bool = False) -> None:
    """One reconcile pass, then the route table it leads to when anything may have moved
    (a full pass, or a change made); runs in a worker thread."""
    close_old_connections()
    try:
        result = reconciler.reconcile_changed(requested=requested)
        if result.errors:
            logger.warning("reconcile pass had errors: %s", "; ".join(result.errors))
        if result.full or result.changed:
            publish_routes()
        else:
            routes.keep_in_redis(settings.REDIS_URL)
    finally:
        _end_of_work()


def _publish_last_table() -> None:
    """The route table as the last pass left it in the database, served at once by a new
    process, before its first pass (which probes every endpoint) ends: the replicas it
    found ready, of the deployments that still exist and run. The first pass then
    confirms them (a replica gone meanwhile is also steered around by the gateway's own
    failure count until then)."""
    close_old_connections()
    try:
        publish_routes()
        table = routes.table.deployments()
        logger.info("serving the route table of the last pass (%d deployments, %d replicas) "
                    "until the first pass confirms it", len(table),
                    sum(len(d.replicas) for d in table))
    finally:
        _end_of_work()


async def run_controllers(stop: asyncio.Event) -> None:
    """Run the controllers until `stop` is set; with leader election, only while leading."""
    election = LeaseElection.from_settings()
    if election is not None:
        logger.info("waiting to lead (Lease %s/%s, as %s)", election.namespace,
                    election.name, election.identity)
        if not await election.acquire(stop):
            return
        keeper = asyncio.get_running_loop().create_task(election.keep(stop))
    try:
        await _run(stop)
    finally:
        if election is not None:
            stop.set()  # also when the controllers ended on their own: the Lease goes
            await keeper


async def _run(stop: asyncio.Event) -> None:
    reconciler = Reconciler(progress=lambda what: liveness.heartbeat.beat(what))
    interval = settings.RECONCILE_INTERVAL_SECONDS
    logger.info("controllers running (reconcile every %.1f s)", interval)
    collecting = asyncio.get_running_loop().create_task(collector.run_collector(stop))
    autoscaler = asyncio.get_running_loop().create_task(run_autoscaler(stop))
    pruning = asyncio.get_running_loop().create_task(run_event_pruning(stop))
    try:
        try:
            await asyncio.to_thread(_publish_last_table)
        except Exception as error:  # the first pass publishes it, or tells the outage
            logger.warning("could not read the last route table: %s", error)
        await _reconcile_loop(reconciler, stop, interval)
    finally:
        reconciler.replicas.pacer.close()  # probes still queued are not waited for
        await asyncio.gather(collecting, autoscaler, pruning, return_exceptions=True)


async def run_autoscaler(stop: asyncio.Event) -> None:
    """A decision after each of the collector's passes (on the figures it just stored),
    or at once when a request starts waiting for a deployment at zero."""
    autoscaler = Autoscaler()
    outage = DatabaseOutage("autoscaler", logger)

    def one_pass() -> bool:
        close_old_connections()
        try:
            return any(d.changes for _, d in autoscaler.run_once())
        finally:
            _end_of_work()

    while not stop.is_set():
        # Woken by the events themselves, not by looking at them every few milliseconds;
        # should the collector's passes stall, every other interval all the same.
        await wait_any((figures_collected, demand.arrived),
                       2 * settings.SCRAPE_INTERVAL, stop)
        if stop.is_set():
            break
        figures_collected.clear()
        demand.arrived.clear()
        if autoscaler.nothing_to_decide():  # no policy anywhere, nothing changed since
            continue
        try:
            if await asyncio.to_thread(one_pass):
                request_reconcile()
            outage.succeeded()
        except Exception as error:
            outage.failed(error)
        messages, autoscaler.charted = autoscaler.charted, []
        await publish_decisions(messages)


async def publish_decisions(messages: list[dict[str, Any]]) -> None:
    """Each decision to the dashboards of its deployment."""
    layer = get_channel_layer()
    if layer is None or not messages:
        return
    try:
        for message in messages:
            await layer.group_send(collector.deployment_group(message["deployment"]), {
                "type": "dashboard.message", "text": orjson.dumps(message).decode()})
    except Exception:
        logger.exception("publishing autoscaler decisions failed")


async def _reconcile_loop(reconciler: Reconciler, stop: asyncio.Event, interval: float) -> None:
    outage = DatabaseOutage("reconcile", logger)
    last_pass = -float("inf")  # time.monotonic() when the last pass began
    while not stop.is_set():
        requested = reconcile_requested.is_set()
        reconcile_requested.clear()
        if not requested and _nothing_to_do(reconciler, last_pass):
            # Told from the schedule and the database file's header, on this thread: a
            # pass that would find nothing is not handed to a worker thread at all.
            liveness.heartbeat.beat("reconcile pass")
            await _wait_for_next(stop, interval)
            continue
        last_pass = time.monotonic()
        try:
            await asyncio.to_thread(_one_pass, reconciler, requested)
            outage.succeeded()
        except Exception as error:
            # Nothing is changed by a pass that cannot read the database: the replicas run
            # on, unobserved, and the next pass after the outage picks them up.
            outage.failed(error)
        # A pass that ended, even in an error, is progress: the liveness check and the
        # Lease's renewal look at this (controlplane/liveness.py).
        liveness.heartbeat.beat("reconcile pass")
        await _wait_for_next(stop, interval)


def _nothing_to_do(reconciler: Reconciler, last_pass: float) -> bool:
    """A pass now would visit nothing and see no change (PassSchedule.quiet), and with
    REDIS_URL, the last one (which also keeps the route table in Redis) began less than
    ROUTE_TABLE_LOOK_SECONDS ago and wrote the table there if it had to (after a failed
    write every pass tries again, as before)."""
    if not reconciler.schedule.quiet():
        return False
    return not settings.REDIS_URL or (
        not routes.redis_behind and time.monotonic() - last_pass < ROUTE_TABLE_LOOK_SECONDS)


async def _wait_for_next(stop: asyncio.Event, interval: float) -> None:
    """Until the interval has passed, a pass is asked for, or `stop` is set: woken by the
    events themselves, so an idle control plane sleeps between passes."""
    await reconcile_requested.wait_async(until_beat(interval), stop)
