"""Where a first token's time went, as the gateway benchmark splits it: the fake engine
started by the benchmarks stamps each stream's first event with when the request arrived
and when the event left (fakes/engine.py --stamp), and the load client splits each
request's time to first token into the leg before the engine, the one in it and the one
back; an engine that does not stamp leaves no legs."""

from __future__ import annotations

import asyncio
import re

from bench.path_figures import Side, legs_text
from bench.planes import start_engine
from bench.stream_load import load
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
