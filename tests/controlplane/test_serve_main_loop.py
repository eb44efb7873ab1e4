"""`manage.py serve`'s main loop wakes once a second (the Date header) or at once for a
stopping signal, not ten times a second as uvicorn's own: an idle server sleeps, a
stopped one still stops at once, and the Date header its answers carry stays current."""

from __future__ import annotations

import asyncio
import gc
import signal
import time
import weakref
from email.utils import parsedate_to_datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil

from controlplane.management.commands.serve import (
    SERVING_GC_THRESHOLDS,
    quiet_main_loop,
    waking_handle_exit,
)
from tests.processes import free_port, manage, server_env, start_server, stop_server


class TickingServer(SimpleNamespace):
    """What the main loop needs of uvicorn's Server: on_tick, should_exit, the signals
    handle_exit records."""

    def __init__(self) -> None:
        super().__init__(should_exit=False, force_exit=False, _captured_signals=[],
                         ticks=[])

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append((counter, time.monotonic()))
        return bool(self.should_exit)


async def test_a_signal_ends_the_main_loop_at_once_and_the_header_ticks_each_second(
) -> None:
    server: Any = TickingServer()
    loop = asyncio.get_running_loop()
    running = loop.create_task(quiet_main_loop(server))
    while len(server.ticks) < 3:  # the first tick at start, then one on each beat
        await asyncio.sleep(0.05)
    first, second, third = server.ticks[:3]
    assert all(tick[0] % 10 == 0 for tick in server.ticks)  # each renews the Date header
    assert 0.45 <= second[1] - first[1] <= 1.6
    assert 0.9 <= third[1] - second[1] <= 1.5
    # On the whole seconds of the loop's clock (time.monotonic here), where the load
    # watcher and the other periodic work wake too: one wake-up a second for all.
    off_beat = second[1] % 1.0
    assert min(off_beat, 1.0 - off_beat) < 0.2, second[1]
    asked = time.monotonic()
    waking_handle_exit(server, signal.SIGTERM, None)
    await asyncio.wait_for(running, 0.5)  # not left for the rest of the second
    assert time.monotonic() - asked < 0.5
    assert server._captured_signals == [signal.SIGTERM]


def test_the_served_process_sleeps_when_idle_and_stops_at_once(tmp_path: Path) -> None:
    env = server_env(tmp_path / "data")
    manage(env, "migrate", "--noinput", "-v0")
    port = free_port()
    process, _ = start_server(env, port, "--no-controllers")
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        dated = parsedate_to_datetime(answer.headers["date"]).timestamp()
        assert abs(dated - time.time()) < 3  # the header is kept current
        # No request: the main thread's wake-ups are the load watcher's (once a second)
        # and the main loop's (once a second), not uvicorn's ten a second.
        switches = psutil.Process(process.pid).num_ctx_switches().voluntary
        time.sleep(3)  # a window to count in, not a wait for a condition
        per_second = (psutil.Process(process.pid).num_ctx_switches().voluntary
                      - switches) / 3
        assert per_second < 8, per_second
        asked = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        assert time.monotonic() - asked < 0.9  # not a tick later
    finally:
        if process.poll() is None:
            stop_server(process)


async def test_the_main_loop_keeps_what_the_server_started_with_out_of_full_collections(
) -> None:
    # A full collection scans every object the collector tracks: with Django and the
    # application loaded (about 100,000), one stalled the event loop for some 25 ms
    # (bench/gc_pause.py).
    # Once serving, what the server started with is frozen, so only what requests leave
    # is scanned; garbage found at that moment is collected, not kept.
    gc.unfreeze()
    thresholds = gc.get_threshold()
    marker = Cycle()
    marker.me = marker  # garbage only the collector can free
    gone = weakref.ref(marker)
    del marker
    started_with = len(gc.get_objects())
    server: Any = TickingServer()
    running = asyncio.get_running_loop().create_task(quiet_main_loop(server))
    try:
        while not server.ticks:
            await asyncio.sleep(0.01)
        assert gc.get_freeze_count() >= started_with * 0.9
        assert gone() is None  # collected before the freeze, not kept for good
        # and the youngest objects are scanned after 20,000 new ones, not 700: a burst
        # of requests is not scanned over and over while it is in use
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
        assert SERVING_GC_THRESHOLDS[0] >= 10_000
    finally:
        server.should_exit = True
        waking_handle_exit(server, signal.SIGTERM, None)
        await asyncio.wait_for(running, 2)
        gc.unfreeze()  # the rest of the test run is not a server
        gc.set_threshold(*thresholds)


class Cycle:
    """An object in a reference cycle."""

    me: Any = None
