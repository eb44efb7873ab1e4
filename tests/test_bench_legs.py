"""Where a first token's time went, as the gateway benchmark splits it: the fake engine
started by the benchmarks stamps each stream's first event with when the request arrived
and when the event left (fakes/engine.py --stamp), and the load client splits each
request's time to first token into the leg before the engine, the one in it and the one
back; an engine that does not stamp leaves no legs. Through the project's gateway, the
leg before the engine also gives the part spent in the gateway, from its usage records."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

from bench.path_figures import Endpoint, Load, Side, interleave, legs_text
from bench.planes import ControlPlane, start_engine
from bench.stream_load import Run, load
from bench.usage_waits import wait_for_records
from tests.engines import start_fake_engine


def test_each_first_token_is_split_into_legs_on_one_clock() -> None:
    process, url = start_engine(20, "fake")
    try:
        run = asyncio.run(load(url, "fake", 3, 4, None, 2))
    finally:
        process.kill()
        process.wait(timeout=10)
    assert run.errors == 0 and len(run.legs) == len(run.ttfts) == 6
    for to_engine, in_engine, back in run.legs:
        # One clock on both sides: no leg runs backwards, and the engine's own leg is its
        # pace (20 ms to the first token; its loop's timers may fire up to a millisecond
        # early), not an offset between two clocks.
        assert to_engine >= 0 and back >= 0
        assert 0.018 <= in_engine < 0.5
    for ttft in run.ttfts:  # every request's legs add up to one of the measured TTFTs
        assert any(abs(sum(legs) - ttft) < 1e-4 for legs in run.legs)
    text = legs_text(Side([run], 0.0))
    shown = re.match(r"legs p50/p90: to engine [\d.]+/[\d.]+, in engine ([\d.]+)/", text)
    assert shown is not None and 18 <= float(shown.group(1)) < 500  # ms, as each leg above


def test_an_engine_that_does_not_stamp_leaves_no_legs() -> None:
    engine = start_fake_engine("plain", interval_ms=1)
    try:
        run = asyncio.run(load(engine.url, "fake", 2, 3, None, 1))
    finally:
        engine.process.kill()
        engine.process.wait(timeout=10)
    assert run.errors == 0 and len(run.ttfts) == 2 and run.legs == []
    assert legs_text(Side([run], 0.0)) == ""


def test_the_gateways_own_part_of_the_leg_to_the_engine_comes_from_its_records() -> None:
    engine, url = start_engine(5, "fake")
    plane = ControlPlane()
    try:
        plane.route("fake", url)
        gateway = Endpoint("gateway", {"fake": plane.url}, plane.key, {},
                           database=plane.database)
        side, = interleave(Load("tiny", "paced", "fake", 3, 2, 4), [gateway], 1)
    finally:
        plane.stop()
        engine.kill()
        engine.wait(timeout=10)
        shutil.rmtree(Path(plane.env["DATA_DIR"]).parent, ignore_errors=True)
    # Every request of the round, none of the warm-up before it; each held a while in
    # the gateway, less than its whole way to the engine (client, gateway, engine).
    assert side.errors == 0 and len(side.held) == len(side.runs[0].legs) == 6
    assert all(0 < held < 5 for held in side.held)
    legs, held = side.legs(0.5), Run(side.held, 0, 1, 0).p(0.5)
    assert legs is not None and held < legs[0]
    shown = re.match(r"legs p50/p90: to engine ([\d.]+)/[\d.]+ \(in the gateway "
                     r"([\d.]+)/[\d.]+\), in engine", legs_text(side))
    assert shown is not None and abs(float(shown.group(2)) - held) < 0.1


def test_no_database_there_gives_no_records_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    assert wait_for_records(tmp_path / "db.sqlite3", "2026-01-01 00:00:00.000000", 5) == []
    assert time.monotonic() - started < 1
