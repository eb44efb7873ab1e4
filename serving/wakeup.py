"""`Wakeup`: a `threading.Event` that an event loop can wait on without polling. A thread
(a request handler, a reconcile pass, a service function) sets it; a loop waiting in
`wait_async` is woken at once through `call_soon_threadsafe` (`call_soon` when set on that
loop's own thread). The controllers' loops wait
on these between passes instead of looking at the event every few milliseconds, so an idle
control plane does not wake up for nothing (docs/benchmarks.md, idle CPU).

`until_beat`: how long periodic work waits for its next turn, so that the loop's periodic
jobs (the Date header, the load watcher, the figures publisher, the reconcile and
collector passes, the usage writer) wake together, once a beat, not each on its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading


def until_beat(period: float) -> float:
    """Seconds from now until the running loop's clock (`loop.time()`) next reaches a
    whole multiple of `period`, at least half a period away: periodic work that waits
    this long, rather than `period` from whenever its last turn ended, runs in the same
    turn of the loop as the other periodic work whose period divides or is divided by its
    own: each wake-up of the loop has a cost of its own (the poll, the turn, what it
    touches again after a sleep), so one a second for all of them, not one each at
    unrelated times. A turn that ended less than half a period before the beat waits for
    the one after, so work that takes most of its period (a reconcile pass over a large
    fleet) still rests about a period between turns, not a moment."""
    if period <= 0:
        return 0.0
    delay = period - asyncio.get_running_loop().time() % period
    return delay if delay >= period / 2 else delay + period


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Wakeup(threading.Event):
    """A threading.Event whose `set()` also wakes the event loops waiting in
    `wait_async` (or in `wait_any` on it and others)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def set(self) -> None:
        super().set()
        with self._lock:
            waiters = list(self._waiters)
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed meanwhile
                if loop is here:  # set on the loop's own thread: no need to wake it
                    loop.call_soon(_resolve, future)
                else:
                    loop.call_soon_threadsafe(_resolve, future)

    async def wait_async(self, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Wait until the event is set, `stop` is set, or `timeout` seconds have passed;
        returns whether the event is set."""
        return await wait_any((self,), timeout, stop)


async def wait_any(wakeups: tuple[Wakeup, ...], timeout: float,
                   stop: asyncio.Event | None = None) -> bool:
    """Wait until one of `wakeups` is set, `stop` is set, or `timeout` seconds have
    passed; returns whether one of them is set."""
    if any(w.is_set() for w in wakeups):
        return True
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    entry = (loop, future)
    for wakeup in wakeups:
        with wakeup._lock:
            wakeup._waiters.add(entry)
    stopping = None
    if stop is not None:
        stopping = loop.create_task(stop.wait())
        stopping.add_done_callback(lambda _: _resolve(future))
    try:
        # Not set between the first look and the registration.
        if not any(w.is_set() for w in wakeups):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await future
    finally:
        for wakeup in wakeups:
            with wakeup._lock:
                wakeup._waiters.discard(entry)
        if stopping is not None:
            stopping.cancel()
    return any(w.is_set() for w in wakeups)
