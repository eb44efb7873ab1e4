"""`Wakeup`: the controllers' loops sleep between passes and are woken by the event."""

from __future__ import annotations

import asyncio
import threading
import time

from serving.wakeup import Wakeup


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
