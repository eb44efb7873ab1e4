"""The gateway's load scrape (serving/gateway/watcher.py): the queues of replicas that
share a pool are read for least-load routing; a replica alone in its pool is not scraped
(its load would choose nothing), unless it sits out after a failure, when an answer takes
it back in."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from serving.gateway.watcher import scrape_load
from serving.router import Router
from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from serving.upstream import ConnectionPool
from tests.endpoints import write_body

# Marks the scrapes this file's tests make. The in-process gateway other tests start (a
# session fixture) runs its own load watcher, which scrapes whatever table is published,
# these tests' too: its scrapes are answered, not counted.
SCRAPER_HEADER = "x-test-scraper"


class MarkedPool(ConnectionPool):
    """A connection pool whose GETs carry SCRAPER_HEADER."""

    async def get_text(self, base_url: str, path: str,
                       headers: tuple[tuple[str, str], ...] = ()) -> str:
        return await super().get_text(base_url, path, (*headers, (SCRAPER_HEADER, "1")))


@contextmanager
def metrics_server(running: dict[str, int]) -> Iterator[tuple[str, Counter[str]]]:
    """One HTTP server standing in for several replicas (by path prefix /<name>): each
    serves vLLM's two queue gauges; the scrapes of each by a MarkedPool are counted."""
    scrapes: Counter[str] = Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.strip("/").split("/")[0]
            if self.headers.get(SCRAPER_HEADER):
                scrapes[name] += 1
            body = (f'vllm:num_requests_running{{model_name="fake"}} {running[name]}\n'
                    f'vllm:num_requests_waiting{{model_name="fake"}} 0\n').encode()
            self.send_response(200)
            write_body(self, body, "text/plain; version=0.0.4")

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", scrapes
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def table() -> Iterator[None]:
    yield
    routes.publish(build_table([]))


async def test_only_replicas_that_share_a_pool_or_sit_out_are_scraped(table: Any) -> None:
    running = {"alone-1": 7, "pair-1": 3, "pair-2": 0}
    with metrics_server(running) as (url, scrapes):
        alone = RouteReplica("alone-1", f"{url}/alone-1")
        pair = (RouteReplica("pair-1", f"{url}/pair-1"), RouteReplica("pair-2", f"{url}/pair-2"))
        routes.publish(build_table([
            DeploymentRoutes("alone", "alone", "least-load", 2048, (alone,), ("alone",)),
            DeploymentRoutes("pair", "pair", "least-load", 2048, pair, ("pair",))]))
        router = Router()
        resources: Any = SimpleNamespace(router=router, scrapes=MarkedPool())
        try:
            await scrape_load(resources)
            assert scrapes == {"pair-1": 1, "pair-2": 1}
            assert router.load("pair-1") == 3 and router.load("pair-2") == 0
            # Least load picks the idle one of the pair.
            pool = routes.table.routes_for("pair")
            assert pool is not None
            picked = router.choose(pool)
            assert picked is not None and picked.name == "pair-2"

            # The lone replica fails a request: it sits out and is scraped until it answers.
            router.failed("alone-1")
            lone = routes.table.routes_for("alone")
            assert lone is not None and router.choose(lone) is None
            await scrape_load(resources)
            assert scrapes["alone-1"] == 1
            chosen = router.choose(lone)
            assert chosen is not None and chosen.name == "alone-1"  # taken back in
            await scrape_load(resources)
            assert scrapes["alone-1"] == 1  # healthy and alone again: not scraped
            assert scrapes["pair-1"] == scrapes["pair-2"] == 3
        finally:
            resources.scrapes.close()


async def test_the_gateways_own_requests_are_not_counted_twice(table: Any) -> None:
    """The engine's queue holds this gateway's own requests, which its in-flight count
    keeps current: a scrape that caught one of them running must not leave the replica
    counted busy after it ended (a session's home replica would be passed over until
    the next scrape). Requests the engine has from elsewhere still count."""
    running = {"own-1": 1, "own-2": 3}
    with metrics_server(running) as (url, _):
        pair = (RouteReplica("own-1", f"{url}/own-1"), RouteReplica("own-2", f"{url}/own-2"))
        routes.publish(build_table([
            DeploymentRoutes("own", "own", "session", 2048, pair, ("own",))]))
        router = Router()
        resources: Any = SimpleNamespace(router=router, scrapes=MarkedPool())
        try:
            router.state("own-1").in_flight = 1  # ours, running on the engine
            router.state("own-2").in_flight = 1  # ours; the engine has 2 from elsewhere
            await scrape_load(resources)
            assert router.load("own-1") == 1 and router.load("own-2") == 3
            router.state("own-1").in_flight = 0  # our request ended after the scrape
            router.state("own-2").in_flight = 0
            assert router.load("own-1") == 0 and router.load("own-2") == 2
        finally:
            resources.scrapes.close()


async def test_waiters_take_the_slots_of_a_replica_that_comes_or_ends_sitting_out(
        table: Any) -> None:
    """The queue's slots follow the route table and the replicas sitting out, whether or
    not anything else changed; the estimated wait is published while requests wait and
    goes back to 0 when none does."""
    import asyncio

    from serving import metrics
    from serving.admission import Admission
    from serving.gateway.watcher import refresh_capacity
    from serving.priority import PriorityClass

    one = RouteReplica("slots-1", "http://127.0.0.1:9")
    two = RouteReplica("slots-2", "http://127.0.0.1:9")
    routes.publish(build_table([DeploymentRoutes("slots", "slots", "least-load", 2048,
                                                 (one,), ("slots",), replica_concurrency=1)]))
    router = Router()
    resources: Any = SimpleNamespace(router=router, admission=Admission(),
                                     capacity_seen=None, estimated=set())
    gauge = metrics.child(metrics.QUEUE_ESTIMATE, "slots")
    refresh_capacity(resources)
    admission = resources.admission
    standard = PriorityClass("standard", 1, 10, 30)
    first = await admission.acquire("slots|all", 1, standard)
    waiting = asyncio.ensure_future(admission.acquire("slots|all", 1, standard))
    await asyncio.sleep(0)
    assert not waiting.done()
    refresh_capacity(resources)
    assert gauge._value.get() > 0  # a request waits: its estimate is out
    # A second replica: the waiter takes its slot at the next look.
    routes.publish(build_table([DeploymentRoutes("slots", "slots", "least-load", 2048,
                                                 (one, two), ("slots",),
                                                 replica_concurrency=1)]))
    refresh_capacity(resources)
    second = await asyncio.wait_for(waiting, 1)
    refresh_capacity(resources)
    assert gauge._value.get() == 0  # nobody waits any more
    admission.release(first.lane)
    admission.release(second.lane)

    # One replica sits out after a failure: one slot; a third request waits ...
    router.failed("slots-2")
    refresh_capacity(resources)
    held = await admission.acquire("slots|all", 2, standard)
    third = asyncio.ensure_future(admission.acquire("slots|all", 1, standard))
    await asyncio.sleep(0)
    assert not third.done()
    # ... until its time out is over: the table is the same, the replicas sitting out not.
    router.states["slots-2"].unhealthy_until = 0.0
    refresh_capacity(resources)
    admission.release((await asyncio.wait_for(third, 1)).lane)
    admission.release(held.lane)
