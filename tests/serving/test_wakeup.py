"""`Wakeup`: the controllers' loops sleep between passes and are woken by the event."""

from __future__ import annotations

import asyncio
import threading
import time

from serving.wakeup import Wakeup, until_beat, wait_any


async def test_a_set_from_another_thread_wakes_the_waiting_loop_at_once() -> None:
    wakeup = Wakeup()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, lambda: threading.Thread(target=wakeup.set).start())
    started = time.monotonic()
    assert await wakeup.wait_async(30.0) is True
    # Woken by the set, long before the 30 s timeout (a bound loose enough for a busy
    # machine, far below the timeout).
    assert time.monotonic() - started < 10.0


async def test_without_a_set_it_returns_false_after_the_timeout() -> None:
    wakeup = Wakeup()
    started = time.monotonic()
    assert await wakeup.wait_async(0.1) is False
    assert time.monotonic() - started >= 0.09
    assert not wakeup._waiters  # nothing left registered


async def test_a_stop_ends_the_wait_without_the_event() -> None:
    wakeup = Wakeup()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    assert await wakeup.wait_async(30.0, stop) is False
    assert time.monotonic() - started < 10.0


async def test_an_event_already_set_returns_at_once_and_stays_set() -> None:
    wakeup = Wakeup()
    wakeup.set()
    assert await wakeup.wait_async(30.0) is True
    assert wakeup.is_set()
    wakeup.clear()
    assert not wakeup.is_set()


async def test_a_wait_on_several_ends_with_whichever_is_set_first() -> None:
    figures, demand = Wakeup(), Wakeup()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, lambda: threading.Thread(target=demand.set).start())
    started = time.monotonic()
    assert await wait_any((figures, demand), 30.0) is True
    assert time.monotonic() - started < 10.0
    assert demand.is_set() and not figures.is_set()
    demand.clear()
    # Set on the loop's own thread (the collector's pass ending): woken too.
    loop.call_later(0.05, figures.set)
    assert await wait_any((figures, demand), 30.0) is True
    assert figures.is_set()
    figures.clear()
    assert await wait_any((figures, demand), 0.05) is False  # neither: the timeout
    assert not figures._waiters and not demand._waiters  # nothing left registered


async def test_periodic_work_started_apart_wakes_together_on_the_beat() -> None:
    loop = asyncio.get_running_loop()
    woke: dict[str, list[float]] = {"early": [], "late": []}

    async def every(period: float, name: str) -> None:
        for _ in range(3):
            await asyncio.sleep(until_beat(period))
            woke[name].append(loop.time())

    early = loop.create_task(every(0.1, "early"))
    await asyncio.sleep(0.037)  # started out of step with the first
    late = loop.create_task(every(0.1, "late"))
    await asyncio.gather(early, late)
    # Both on the beat from the first wait on, in the same turns of the loop (a loop
    # woken by a timer runs every timer then due), not 37 ms apart.
    for when in woke["early"] + woke["late"]:
        off_beat = when % 0.1
        assert min(off_beat, 0.1 - off_beat) < 0.03, when
    beats = [*woke["early"], woke["early"][-1] + 0.1]
    for when in woke["late"]:
        assert min(abs(when - beat) for beat in beats) < 0.01, (when, beats)


async def test_the_wait_is_between_half_a_period_and_one_and_a_half() -> None:
    # Work that ended just before a beat rests until the next (a pass that took most of
    # its period is not started again at once).
    delays = []
    for _ in range(50):
        delays.append(until_beat(0.01))
        await asyncio.sleep(0.0013)
    assert all(0.005 <= delay <= 0.015 for delay in delays), delays
    assert any(delay > 0.0101 for delay in delays)  # some ended within half a period
    assert until_beat(0.0) == 0.0  # no period: no wait
