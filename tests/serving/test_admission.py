"""The priority queue (serving/admission.py): priority first, then arrival; aging so a
lower class does not starve; a bounded queue per class (429) and a bounded wait (503),
both with a Retry-After from the measured service rate; a client that leaves frees its
place or its slot."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from serving.admission import Admission, Refused
from serving.priority import PriorityClass, parse_classes

CRITICAL = PriorityClass("critical", 0, 100, 30)
STANDARD = PriorityClass("standard", 10, 100, 30)
BATCH = PriorityClass("batch", 20, 100, 30)
SHARED_BATCH = PriorityClass("batch", 20, 100, 30, share=0.75)


async def until(check: Any, what: str) -> None:
    """Let the waiting tasks run until `check()` holds (bounded)."""
    deadline = asyncio.get_running_loop().time() + 5
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def enter(admission: Admission, name: str, priority: PriorityClass,
                log: list[str], capacity: int = 1) -> None:
    await admission.acquire("demo|all", capacity, priority)
    log.append(name)


def test_waiters_go_by_priority_then_arrival() -> None:
    async def run() -> list[str]:
        admission, log = Admission(), list[str]()
        await admission.acquire("demo|all", 1, STANDARD)  # the one slot is taken
        tasks = []
        for name, priority in (("batch-1", BATCH), ("standard-1", STANDARD),
                               ("batch-2", BATCH), ("critical-1", CRITICAL),
                               ("standard-2", STANDARD)):
            tasks.append(asyncio.create_task(enter(admission, name, priority, log)))
            await asyncio.sleep(0)
        assert admission.queued("demo") == {"batch": 2, "standard": 2, "critical": 1}
        for _ in tasks:
            admission.release("demo|all")  # one finishes, the next best goes in
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return log

    assert asyncio.run(run()) == ["critical-1", "standard-1", "standard-2", "batch-1",
                                  "batch-2"]


def test_batch_never_fills_the_headroom_an_urgent_request_takes_at_once() -> None:
    async def run() -> tuple[list[str], int]:
        admission, log = Admission(), list[str]()
        batch = [asyncio.create_task(enter(admission, f"batch-{n}", SHARED_BATCH, log, 4))
                 for n in range(5)]
        await until(lambda: admission.lane("demo|all").waiting() == 2, "two to wait")
        assert log == ["batch-0", "batch-1", "batch-2"]  # 3 of 4 slots: the rest waits
        ticket = await admission.acquire("demo|all", 4, CRITICAL)
        log.append("critical")
        busy = admission.lane("demo|all").busy
        for _ in range(3):  # each release lets in the next waiter the share allows
            admission.release("demo|all")
        await asyncio.gather(*batch)
        assert ticket.position == 0 and ticket.waited == 0
        return log, busy

    log, busy = asyncio.run(run())
    assert log == ["batch-0", "batch-1", "batch-2", "critical", "batch-3", "batch-4"]
    assert busy == 4


def test_aging_lets_a_long_waiting_batch_request_pass_fresh_critical_ones(
        settings: Any) -> None:
    settings.GATEWAY_QUEUE_AGING_SECONDS = 0.01  # one level per 10 ms waited

    async def run() -> list[str]:
        admission, log = Admission(), list[str]()
        await admission.acquire("demo|all", 1, STANDARD)
        old = asyncio.create_task(enter(admission, "batch-old", BATCH, log))
        await asyncio.sleep(0.5)  # 50 levels of aging: ahead of a new critical (0)
        fresh = asyncio.create_task(enter(admission, "critical-new", CRITICAL, log))
        await asyncio.sleep(0)
        admission.release("demo|all")
        await asyncio.sleep(0)
        admission.release("demo|all")
        await asyncio.gather(old, fresh)
        return log

    assert asyncio.run(run()) == ["batch-old", "critical-new"]


def test_a_full_class_queue_is_refused_with_429_and_a_retry_after() -> None:
    small = PriorityClass("batch", 20, 2, 30)

    async def run() -> Refused:
        admission = Admission()
        await admission.acquire("demo|all", 1, STANDARD)
        # Measure a service rate: four requests finished over about 0.3 s.
        for _ in range(4):
            admission.release("demo|all")
            await admission.acquire("demo|all", 1, STANDARD)
            await asyncio.sleep(0.1)
        waiting = [asyncio.create_task(admission.acquire("demo|all", 1, small))
                   for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as refused:
            await admission.acquire("demo|all", 1, small)
        # Another class still has room.
        other = asyncio.create_task(admission.acquire("demo|all", 1, CRITICAL))
        await asyncio.sleep(0)
        assert admission.queued("demo") == {"batch": 2, "critical": 1}
        assert 0 < admission.estimated_wait("demo") < 5  # from the measured rate
        for task in [*waiting, other]:
            task.cancel()
        return refused.value

    refused = asyncio.run(run())
    assert refused.status == 429 and refused.code == "queue_full"
    assert "batch queue" in refused.message
    assert 0 < refused.retry_after < 5  # three ahead at ~10 per second


def test_a_wait_past_the_class_limit_is_refused_with_503() -> None:
    hurried = PriorityClass("critical", 0, 10, 0.2)

    async def run() -> tuple[Refused, int]:
        admission = Admission()
        await admission.acquire("demo|all", 1, STANDARD)
        with pytest.raises(Refused) as refused:
            await admission.acquire("demo|all", 1, hurried)
        return refused.value, admission.lane("demo|all").waiting()

    refused, left = asyncio.run(run())
    assert refused.status == 503 and refused.code == "queue_timeout"
    assert refused.retry_after >= 0.2 and left == 0  # not left in the queue


def test_a_client_that_leaves_frees_its_place_and_new_capacity_is_used() -> None:
    async def run() -> list[str]:
        admission, log = Admission(), list[str]()
        await admission.acquire("demo|all", 1, STANDARD)
        gone = asyncio.create_task(enter(admission, "gone", CRITICAL, log))
        stays = asyncio.create_task(enter(admission, "stays", BATCH, log))
        await until(lambda: admission.lane("demo|all").waiting() == 2, "both to wait")
        gone.cancel()
        await until(gone.done, "the client to leave")
        assert admission.queued("demo") == {"batch": 1}
        admission.set_capacity("demo|all", 2)  # a replica joined: the waiter goes in
        await asyncio.wait_for(stays, 1)
        return log

    assert asyncio.run(run()) == ["stays"]


def test_priority_classes_are_read_strictly() -> None:
    classes = parse_classes('{"standard": {"level": 5}, "low": {"level": 9, '
                            '"max_queued": 3, "max_wait_seconds": 1.5}}')
    assert classes["low"] == PriorityClass("low", 9, 3, 1.5)
    assert classes["standard"].max_queued == 1000
    for text, error in (("[1]", "JSON object"), ("{nope", "not JSON"),
                        ('{"low": {"level": 1}}', "'standard'"),
                        ('{"standard": {"level": "high"}}', "level"),
                        ('{"standard": {"level": 1, "max_queued": -1}}', "max_queued"),
                        ('{"standard": {"level": 1, "speed": 3}}', "takes level"),
                        ('{"standard": {"level": 1, "share": 0}}', "share"),
                        ('{"no good": {"level": 1}}', "identifier")):
        with pytest.raises(ValueError, match=error):
            parse_classes(text)


def test_a_lane_that_never_queues_keeps_only_its_rate_window_of_finished_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import admission as module

    clock = [1000.0]  # the admission module's clock only; the event loop keeps its own
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def run() -> int:
        admission = Admission()
        for _ in range(500):  # never a waiter: no estimate is ever asked for
            await admission.acquire("demo|all", 8, STANDARD)
            admission.release("demo|all")
            clock[0] += 1.0
        return len(admission.lane("demo|all").finished)

    assert asyncio.run(run()) == module.RATE_WINDOW + 1
