"""The controllers' runner (controlplane/controllers.py): what a pass in a worker thread
leaves behind on that thread, and the loop between passes: asleep until the interval ends
or a pass is asked for, woken at once by a request from another thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from django.db import connection

from controlplane import controllers
from controlplane.controllers import _wait_for_next
from controlplane.reconciler import Reconciler
from controlplane.wakeups import reconcile_requested, request_reconcile
from serving.wakeup import Wakeup
from tests.factories import make_deployment


@pytest.mark.django_db(transaction=True)
def test_a_pass_in_debug_leaves_no_query_log_on_its_thread(settings: Any) -> None:
    settings.DEBUG = True  # Django logs every query of a connection, up to 9,000
    make_deployment("demo")
    Reconciler().reconcile_all()
    assert len(connection.queries) > 0  # what a pass leaves without the runner
    controllers._one_pass(Reconciler())
    assert connection.queries == []


@pytest.mark.django_db(transaction=True)
def test_passes_on_one_thread_keep_its_database_connection() -> None:
    # A pass runs about once a second: opening the database (for SQLite, the file and
    # its functions; for PostgreSQL, a session) for each was most of an idle pass's cost.
    make_deployment("demo")
    reconciler = Reconciler()
    controllers._one_pass(reconciler)
    kept = connection.connection
    assert kept is not None  # left open for the next pass
    controllers._one_pass(reconciler)
    assert connection.connection is kept


async def test_a_pass_asked_for_from_a_thread_ends_the_wait_at_once() -> None:
    reconcile_requested.clear()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(
        0.05, lambda: threading.Thread(target=request_reconcile).start())
    started = time.monotonic()
    await _wait_for_next(stop, 60.0)
    # Long before the interval (a loose bound: the machine may be busy).
    assert time.monotonic() - started < 10.0
    assert reconcile_requested.is_set()
    reconcile_requested.clear()


async def test_with_nothing_asked_the_wait_ends_on_the_next_beat() -> None:
    # A multiple of the interval on the loop's clock (the other periodic work wakes then
    # too), the first at least half an interval away: never sooner, never more than one
    # and a half intervals.
    reconcile_requested.clear()
    loop = asyncio.get_running_loop()
    for _ in range(3):
        started = loop.time()
        await _wait_for_next(asyncio.Event(), 0.2)
        ended = loop.time()
        assert 0.09 <= ended - started <= 0.3 + 0.1  # (a loose bound for a busy machine)
        off_beat = ended % 0.2
        assert min(off_beat, 0.2 - off_beat) < 0.05, ended
    assert not reconcile_requested.is_set()


async def test_stopping_ends_the_wait() -> None:
    reconcile_requested.clear()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    await _wait_for_next(stop, 60.0)
    assert time.monotonic() - started < 10.0


async def test_the_autoscaler_decides_after_each_collector_pass(
        monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """A decision reads the figures of the pass just stored: the dashboard's newest
    sample is the one it annotates (not one the collector adds a moment later)."""
    settings.SCRAPE_INTERVAL = 30.0  # no decision on the interval within the test
    decided: list[float] = []

    class Recording:
        charted: list[Any] = []

        def nothing_to_decide(self) -> bool:
            return False

        def run_once(self) -> list[Any]:
            decided.append(time.monotonic())
            return []

    monkeypatch.setattr(controllers, "Autoscaler", Recording)
    # Its own (collectors other tests left running in this process set the shared one).
    figures_collected = Wakeup()
    monkeypatch.setattr(controllers, "figures_collected", figures_collected)
    monkeypatch.setattr(controllers.demand, "arrived", Wakeup())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    running = loop.create_task(controllers.run_autoscaler(stop))
    await asyncio.sleep(0.2)
    assert decided == []  # no pass, no decision
    for expected in (1, 2):
        passed = time.monotonic()
        figures_collected.set()  # as the collector does on the loop's thread
        while len(decided) < expected:
            assert time.monotonic() - passed < 10.0
            await asyncio.sleep(0.01)
        assert decided[-1] >= passed
    stop.set()
    await running
    assert not figures_collected.is_set()


@pytest.mark.django_db(transaction=True)  # the runner closes the thread's connection
def test_a_new_process_routes_from_the_last_pass_before_its_first_pass() -> None:
    """After a restart the route table the last pass left is served at once (its first
    pass, which probes every endpoint, takes long on a large fleet), for the deployments
    that still exist and run, without a probe."""
    from controlplane.models import Deployment, Replica
    from serving.routes import RouteTable, routes
    from tests.endpoints import stand_in_endpoint
    from tests.factories import make_backend

    with stand_in_endpoint() as endpoint:
        for name in ("kept", "deleted-meanwhile", "stopped-meanwhile"):
            make_deployment(name, replicas=1, backend=make_backend(
                name, "external", {"url": endpoint.url}))
        reconciler = Reconciler()
        deadline = time.monotonic() + 10
        while Replica.objects.filter(phase=Replica.Phase.READY).count() < 3:
            assert time.monotonic() < deadline, "replicas never ready"
            reconciler.reconcile_all()
        # While no controller ran: one deployment being deleted, one stopped.
        Deployment.objects.filter(name="deleted-meanwhile").update(deleting=True)
        Deployment.objects.filter(name="stopped-meanwhile").update(
            state=Deployment.State.STOPPED)
        kept = routes.table
        routes.publish(RouteTable())  # what a new process starts with
        probes = endpoint.requests
        try:
            controllers._publish_last_table()
            table = routes.table
        finally:
            routes.publish(kept)
        assert [r.name for r in table.routes_for("kept").replicas] == ["kept-1"]  # type: ignore[union-attr]
        assert table.routes_for("deleted-meanwhile") is None
        assert table.routes_for("stopped-meanwhile").replicas == ()  # type: ignore[union-attr]
        assert endpoint.requests == probes


def settled_passes_counted(settings: Any, monkeypatch: pytest.MonkeyPatch
                           ) -> tuple[list[float], list[float]]:
    """No probe or full pass falls due during the test and no change asks for a pass;
    when each pass ran, and each beat of the loop (a pass run or skipped), are noted."""
    from controlplane import liveness, services

    settings.HEALTH_CHECK_SECONDS = 3600
    settings.RECONCILE_RESYNC_SECONDS = 3600
    monkeypatch.setattr(services, "request_reconcile", lambda: None)  # as elsewhere
    passes: list[float] = []
    beats: list[float] = []
    one_pass, beat = controllers._one_pass, liveness.heartbeat.beat

    def counted_pass(*args: Any) -> None:
        passes.append(time.monotonic())
        one_pass(*args)

    def counted_beat(what: str) -> None:
        beats.append(time.monotonic())
        beat(what)

    monkeypatch.setattr(controllers, "_one_pass", counted_pass)
    monkeypatch.setattr(liveness.heartbeat, "beat", counted_beat)
    return passes, beats


@pytest.mark.sqlite_file
@pytest.mark.django_db(transaction=True)  # the passes run on threads of their own
def test_a_pass_with_nothing_to_do_is_skipped_and_a_change_made_elsewhere_still_acted_on(
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SQLite a settled fleet's passes are not run at all (no thread, no query) while
    only this process's usage writer commits; a change committed by another process (no
    wake-up here, only its audit event in the database) is acted on at the next beat."""
    from controlplane import services
    from controlplane.models import Deployment, Replica
    from serving.sqlite_commits import counter
    from serving.usage import Usage, write_batch
    from tests.endpoints import stand_in_endpoint
    from tests.factories import make_backend

    assert counter() is not None, "the test database is not a SQLite file"
    settings.REDIS_URL = ""
    passes, beats = settled_passes_counted(settings, monkeypatch)

    def replicas() -> list[str]:
        return sorted(Replica.objects.filter(phase=Replica.Phase.READY)
                      .values_list("deployment__name", flat=True))

    async def skipping(beats_without_a_pass: int) -> None:
        """Until that many beats in a row ran no pass."""
        async with asyncio.timeout(20):
            while len([b for b in beats if not passes or b > passes[-1]]) \
                    < beats_without_a_pass:
                await asyncio.sleep(0.02)

    async def scenario(edge: Deployment) -> None:
        stop = asyncio.Event()
        running = asyncio.get_running_loop().create_task(
            controllers._reconcile_loop(Reconciler(), stop, 0.05))
        try:
            async with asyncio.timeout(20):
                while await asyncio.to_thread(replicas) != ["edge", "other"]:
                    await asyncio.sleep(0.02)
            await skipping(10)
            ran = len(passes)
            await asyncio.to_thread(write_batch, [Usage(
                at=time.time(), request_id="r1", key_id=None, model="fake",
                deployment="edge", replica="edge-1", status=200, stream=False,
                prompt_tokens=1, completion_tokens=1, queue_ms=0.0, ttft_ms=1.0,
                itl_ms=None, e2e_ms=2.0)])
            await skipping(10)
            assert len(passes) == ran  # the usage writer's commit asked for no pass
            await asyncio.to_thread(services.set_deployment_state, edge,
                                    Deployment.State.STOPPED, actor="someone")
            async with asyncio.timeout(20):
                while await asyncio.to_thread(replicas) != ["other"]:
                    await asyncio.sleep(0.02)
        finally:
            stop.set()
            await running

    with stand_in_endpoint() as endpoint:
        edge, _ = (make_deployment(name, replicas=1, backend=make_backend(
            name, "external", {"url": endpoint.url})) for name in ("edge", "other"))
        asyncio.run(scenario(edge))


@pytest.mark.sqlite_file
@pytest.mark.django_db(transaction=True)  # the passes run on threads of their own
def test_with_redis_a_quiet_fleet_passes_only_to_keep_the_route_table_there(
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With REDIS_URL a settled fleet's passes are skipped too, but for one every
    ROUTE_TABLE_LOOK_SECONDS, which puts the route table back in Redis when Redis has
    lost it (a restart without persistence)."""
    import redis

    from serving.routes import REDIS_KEY, routes
    from serving.sqlite_commits import counter
    from tests.endpoints import stand_in_endpoint
    from tests.factories import make_backend
    from tests.services import private_redis

    assert counter() is not None, "the test database is not a SQLite file"
    monkeypatch.setattr(controllers, "ROUTE_TABLE_LOOK_SECONDS", 0.5)
    passes, beats = settled_passes_counted(settings, monkeypatch)

    async def scenario(client: redis.Redis) -> None:
        stop = asyncio.Event()
        running = asyncio.get_running_loop().create_task(
            controllers._reconcile_loop(Reconciler(), stop, 0.05))
        try:
            async with asyncio.timeout(20):  # the first passes: the replica ready, routed
                while not (await asyncio.to_thread(client.exists, REDIS_KEY)
                           and (found := routes.table.routes_for("edge")) is not None
                           and found.replicas):
                    await asyncio.sleep(0.02)
            settled_at, ran = time.monotonic(), len(passes)
            async with asyncio.timeout(20):  # 40 beats of the loop (2 s at 0.05 s each)
                while len([b for b in beats if b > settled_at]) < 40:
                    await asyncio.sleep(0.02)
            quiet_passes = len(passes) - ran
            quiet_beats = len([b for b in beats if b > settled_at])
            # About one pass a half second, where every beat ran one before.
            assert 2 <= quiet_passes <= quiet_beats // 5, (quiet_passes, quiet_beats)
            await asyncio.to_thread(client.delete, REDIS_KEY)  # Redis lost it
            lost_at = time.monotonic()
            async with asyncio.timeout(20):
                while not await asyncio.to_thread(client.exists, REDIS_KEY):
                    await asyncio.sleep(0.02)
            assert time.monotonic() - lost_at < 0.5 + 1.0  # a look, with room for a pass
            server.stop()  # Redis away: the next look fails, and every pass looks again
            async with asyncio.timeout(20):
                while not routes.redis_behind:
                    await asyncio.sleep(0.02)
            behind_at, ran = time.monotonic(), len(passes)
            async with asyncio.timeout(20):  # 10 beats
                while len([b for b in beats if b > behind_at]) < 10:
                    await asyncio.sleep(0.02)
            # Each beat a pass (a pass beats once it ends: one may still be running).
            assert len(passes) - ran >= 9
            server.start()  # back, empty: the table is written at the next pass
            back_at = time.monotonic()
            async with asyncio.timeout(20):  # (the flag is cleared once the write returns)
                while routes.redis_behind or not await asyncio.to_thread(
                        client.exists, REDIS_KEY):
                    await asyncio.sleep(0.02)
            assert time.monotonic() - back_at < 1.0
        finally:
            stop.set()
            await running

    with private_redis() as server, stand_in_endpoint() as endpoint:
        settings.REDIS_URL = server.url
        make_deployment("edge", replicas=1, backend=make_backend(
            "edge", "external", {"url": endpoint.url}))
        client = redis.Redis.from_url(server.url)
        try:
            asyncio.run(scenario(client))
        finally:
            client.close()
