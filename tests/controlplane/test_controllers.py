"""The controllers' loop between passes: asleep until the interval ends or a pass is asked
for, woken at once by a request from another thread."""

from __future__ import annotations

import asyncio
import threading
import time

from controlplane.controllers import _wait_for_next
from controlplane.wakeups import reconcile_requested, request_reconcile


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


async def test_with_nothing_asked_the_wait_lasts_the_interval() -> None:
    reconcile_requested.clear()
    started = time.monotonic()
    await _wait_for_next(asyncio.Event(), 0.2)
    assert time.monotonic() - started >= 0.19
    assert not reconcile_requested.is_set()


async def test_stopping_ends_the_wait() -> None:
    reconcile_requested.clear()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    await _wait_for_next(stop, 60.0)
    assert time.monotonic() - started < 10.0
