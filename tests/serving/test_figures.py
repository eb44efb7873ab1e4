"""The gateway's figures published like the route table (serving/figures.py): each process
writes its snapshot under its own expiring key; the reader sums the live ones, with
counters that never go down when a process dies or starts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis

from serving import metrics
from serving.figures import (
    REDIS_PREFIX,
    FleetFigures,
    Publisher,
    Snapshot,
    fetch_snapshots,
    local_snapshot,
    publish_forever,
)
from serving.redis_script import Commands

REDIS_URL = "redis://127.0.0.1:6379/12"  # a database of its own: others use Redis too


def clear() -> None:
    connection = redis.Redis.from_url(REDIS_URL)
    names = list(connection.scan_iter(REDIS_PREFIX + "*"))
    if names:
        connection.delete(*names)
    connection.close()


@pytest.fixture(autouse=True)
def empty_store() -> Iterator[None]:
    clear()
    yield
    clear()


def snapshot(requests: float = 0, errors: float = 0, in_flight: float = 0,
             queued: float = 0, started: float = 0.0) -> Snapshot:
    return Snapshot(requests={"fig": (requests, errors)}, in_flight={"fig": in_flight},
                    queued={"fig": queued}, queue_wait={"fig": queued / 2}, started=started)


async def publish(process: str, figures: Snapshot, ttl: float = 3.0) -> None:
    connection = Commands(REDIS_URL)  # the gateway's (serving/gateway/resources.py)
    try:
        assert await Publisher(process, ttl=ttl).publish(connection, figures, 0.0)
    finally:
        await connection.close()


async def test_a_process_publishes_its_figures_under_its_own_expiring_key() -> None:
    metrics.child(metrics.IN_FLIGHT, "fig-model", "fig-published").inc(2)
    metrics.child(metrics.QUEUED, "fig-published", "batch").set(3)
    metrics.child(metrics.REQUESTS, "fig-model", "fig-published", "200").inc(5)
    metrics.child(metrics.REQUESTS, "fig-model", "fig-published", "503").inc(1)
    connection = aredis.Redis.from_url(REDIS_URL)
    commands = Commands(REDIS_URL)  # what the gateway publishes through
    publisher = Publisher("gateway-a", ttl=3.0)
    try:
        assert await publisher.publish(commands, local_snapshot(), 100.0)
        stored = Snapshot.from_json(await connection.get(REDIS_PREFIX + "gateway-a") or "")
        assert 0 < await connection.pttl(REDIS_PREFIX + "gateway-a") <= 3000
        assert stored.requests["fig-published"] == (6.0, 1.0)
        assert stored.in_flight["fig-published"] == 2 and stored.queued["fig-published"] == 3
        # Unchanged figures are not written again until the expiry needs renewing.
        assert not await publisher.publish(commands, local_snapshot(), 101.0)
        assert await publisher.publish(commands, local_snapshot(), 101.6)
        metrics.child(metrics.IN_FLIGHT, "fig-model", "fig-published").dec()
        assert await publisher.publish(commands, local_snapshot(), 101.7)
    finally:
        metrics.child(metrics.IN_FLIGHT, "fig-model", "fig-published").dec()
        metrics.child(metrics.QUEUED, "fig-published", "batch").set(0)
        await connection.aclose()
        await commands.close()


def test_a_dead_process_figures_vanish_when_its_key_expires() -> None:
    asyncio.run(publish("gateway-dead", snapshot(in_flight=4, queued=2), ttl=0.3))
    reader = FleetFigures()
    assert reader.read(REDIS_URL, time.time()).in_flight["fig"] == 4
    deadline = time.monotonic() + 5
    while "fig" in reader.read(REDIS_URL, time.time()).in_flight:
        assert time.monotonic() < deadline, "the dead process's figures stayed"
        time.sleep(0.05)


def test_the_reader_sums_every_live_process_and_its_own_registry() -> None:
    asyncio.run(publish("gateway-a", snapshot(requests=10, errors=1, in_flight=2, queued=1)))
    asyncio.run(publish("gateway-b", snapshot(requests=20, in_flight=3, queued=4)))
    reader = FleetFigures()
    first = reader.read(REDIS_URL, 1000.0)
    assert first.in_flight["fig"] == 5 and first.queued["fig"] == 5
    assert first.queue_wait["fig"] == 2.0  # the longest estimate
    assert first.requests["fig"] == (0.0, 0.0)  # where counting starts
    asyncio.run(publish("gateway-a", snapshot(requests=13, errors=2, in_flight=1)))
    asyncio.run(publish("gateway-b", snapshot(requests=24, in_flight=0)))
    second = reader.read(REDIS_URL, 1002.0)
    assert second.requests["fig"] == (7.0, 1.0)  # 3 + 4 answered, 1 failed
    assert second.in_flight["fig"] == 1


def test_a_process_that_dies_or_restarts_never_makes_a_total_go_down() -> None:
    reader = FleetFigures()
    reader.add_up({"a": snapshot(requests=50), "b": snapshot(requests=30)}, 1000.0)
    after = reader.add_up({"a": snapshot(requests=55), "b": snapshot(requests=31)}, 1002.0)
    assert after.requests["fig"] == (6.0, 0.0)
    # b dies; c starts after the last read and has answered 4 already; a answers 1 more.
    after = reader.add_up({"a": snapshot(requests=56),
                           "c": snapshot(requests=4, started=1003.0)}, 1004.0)
    assert after.requests["fig"] == (11.0, 0.0)
    # d was up before the last read and is seen for the first time: counted from now on.
    after = reader.add_up({"a": snapshot(requests=56), "c": snapshot(requests=4),
                           "d": snapshot(requests=900, started=10.0)}, 1006.0)
    assert after.requests["fig"] == (11.0, 0.0)


def test_without_redis_only_this_process_is_read() -> None:
    asyncio.run(publish("gateway-elsewhere", snapshot(in_flight=7)))
    metrics.child(metrics.IN_FLIGHT, "fig-model", "fig-local").inc()
    try:
        figures = FleetFigures().read(None, time.time())
        assert figures.in_flight["fig-local"] == 1
        assert "fig" not in figures.in_flight
    finally:
        metrics.child(metrics.IN_FLIGHT, "fig-model", "fig-local").dec()


async def test_the_reader_never_waits_on_redis_inside_an_event_loop() -> None:
    await publish("gateway-a", snapshot(in_flight=2))
    reader = FleetFigures()
    assert "fig" not in reader.read(REDIS_URL, time.time()).in_flight  # the read has begun
    deadline = time.monotonic() + 5
    while "fig" not in reader.read(REDIS_URL, time.time()).in_flight:
        assert time.monotonic() < deadline, "the read never finished"
        await asyncio.sleep(0.02)


async def test_publishing_goes_on_through_an_unreachable_redis(
        caplog: pytest.LogCaptureFixture) -> None:
    from serving.demand import PROCESS

    # The loop's clients as the gateway makes them (serving/gateway/resources.py).
    unreachable = Commands("redis://127.0.0.1:1/0")  # nothing listens
    reachable = Commands(REDIS_URL)
    clients = {"now": unreachable}
    task = asyncio.get_running_loop().create_task(
        publish_forever(lambda: clients["now"], interval=0.05))
    connection = redis.Redis.from_url(REDIS_URL)
    try:
        with caplog.at_level(logging.WARNING, logger="serving.figures"):
            deadline = time.monotonic() + 5
            while not [r for r in caplog.records if "could not publish" in r.message]:
                assert time.monotonic() < deadline, "the failure was never told"
                await asyncio.sleep(0.02)
            assert not task.done()  # a failure never ends the task
        assert len([r for r in caplog.records if "could not publish" in r.message]) == 1
        clients["now"] = reachable  # the loop's client once REDIS_URL answers again
        deadline = time.monotonic() + 5
        while PROCESS not in fetch_snapshots(connection, skip=""):
            assert time.monotonic() < deadline, "never published once Redis was there"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        connection.close()
        await unreachable.close()
        await reachable.close()
