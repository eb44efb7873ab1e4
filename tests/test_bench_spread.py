"""The side-by-side table's verdicts say whether a missed target's gap stands out of the
rounds' own scatter (bench/spread.py): per round, the gateway's figure against the
router's in the same round. Each path's line also gives the engine's own gaps between
tokens over its rounds, read from the engine's metrics."""

from __future__ import annotations

import math

import httpx
import pytest

from bench.path_figures import ROUTER, Endpoint, Load, Side, print_table
from bench.spread import paired
from bench.stream_load import Run


def test_a_steady_gap_is_told_apart_and_a_scattered_one_is_not() -> None:
    steady = paired([10.0, 11.0, 10.5, 10.2], [9.0, 10.0, 9.5, 9.2])
    assert steady is not None and steady.mean == pytest.approx(1.0)
    assert steady.margin == pytest.approx(0.0, abs=1e-9) and steady.told_apart
    scattered = paired([10.0, 12.0, 9.0, 11.0], [11.0, 9.0, 12.0, 9.5])
    assert scattered is not None and scattered.mean == pytest.approx(0.125)
    # Differences -1, 3, -3, 1.5: sample deviation 2.6, two standard errors 2.6.
    assert scattered.margin == pytest.approx(2 * math.sqrt(
        sum((d - 0.125) ** 2 for d in (-1, 3, -3, 1.5)) / 3 / 4))
    assert not scattered.told_apart


@pytest.mark.parametrize(("a", "b"), [
    ([1.0, 2.0], [1.0, 2.0]),  # too few rounds to state a spread
    ([1.0, 2.0, 3.0], [1.0, 2.0]),  # rounds that do not pair up
    ([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]),
])
def test_no_spread_is_stated_where_it_cannot_be_told(a: list[float],
                                                     b: list[float]) -> None:
    assert paired(a, b) is None


def paths(model: str) -> list[Endpoint]:
    """Direct, a gateway and the router, as the table lists them."""
    return [Endpoint("direct", {}, None, {}), Endpoint("gateway", {}, None, {model: 1}),
            Endpoint(ROUTER, {}, None, {model: 2})]


def side(rates: list[float], cpu_per_round: list[float]) -> Side:
    """A path's rounds: each 1000 events in 1000/rate seconds, with this CPU."""
    runs = [Run([0.01], 1000, 1000 / rate, 0) for rate in rates]
    return Side(runs, sum(cpu_per_round), round_cpu=cpu_per_round)


def test_the_verdict_says_whether_a_miss_is_beyond_the_rounds_noise(
        capsys: pytest.CaptureFixture[str]) -> None:
    load = Load("paced-1", "paced 10 ms/token", "fake", 1, 1)
    endpoints = paths("fake")
    direct = side([100.0, 100.0, 100.0, 100.0], [0.0] * 4)
    # The gateway's throughput a hair below the router's, every round by as much: a
    # gap the rounds tell apart. Its CPU above the router's on the whole, but below it
    # in half the rounds: one they do not.
    gateway = side([99.0, 98.0, 99.0, 98.0], [0.20, 0.05, 0.20, 0.05])
    router = side([99.5, 98.5, 99.5, 98.5], [0.10, 0.10, 0.10, 0.10])
    print_table([(load, endpoints, [direct, gateway, router])], 4)
    lines = capsys.readouterr().out.splitlines()
    ratio = next(line for line in lines if "throughput ratio" in line)
    cpu = next(line for line in lines if line.startswith("target (gateway): CPU"))
    assert ratio.startswith("target (gateway)") and "MISSED" in ratio
    assert "by round -0.0050 ± 0.0000 over 4 rounds, beyond the rounds' noise" in ratio
    assert "MISSED (paced-1: 125.0 against 100.0 µs; by round +25.0 ± " in cpu
    assert "over 4 rounds, not told apart from noise" in cpu


def test_a_single_round_states_no_spread(capsys: pytest.CaptureFixture[str]) -> None:
    load = Load("paced-1", "paced 10 ms/token", "fake", 1, 1)
    endpoints = paths("fake")
    print_table([(load, endpoints, [side([100.0], [0.0]), side([98.0], [0.2]),
                                    side([99.0], [0.1])])], 1)
    out = capsys.readouterr().out
    assert "MISSED (paced-1: 0.9800 against 0.9900)\n" in out
    assert "MISSED (paced-1: 200.0 against 100.0 µs)\n" in out


def test_a_missed_ttft_target_is_judged_past_its_allowance(
        capsys: pytest.CaptureFixture[str]) -> None:
    load = Load("unpaced-64", "unpaced", "fast", 64, 8)
    endpoints = paths("fast")

    def rounds(p50s_ms: list[float]) -> Side:
        return Side([Run([p / 1000] * 3, 1000, 10.0, 0) for p in p50s_ms], 0.0,
                    round_cpu=[0.0] * len(p50s_ms))

    # Direct's p50 moves from round to round and cancels: the gateway is 8 ms after the
    # router in every round, 6 past the 2 allowed.
    direct, gateway, router = (rounds([10.0, 30.0, 20.0]), rounds([20.0, 40.0, 30.0]),
                               rounds([12.0, 32.0, 22.0]))
    print_table([(load, endpoints, [direct, gateway, router])], 3)
    out = capsys.readouterr().out
    assert ("added TTFT p50 within the router's + 2 ms on every row: MISSED (unpaced-64: "
            "+10.0 against +2.0 ms; by round +6.0 ± 0.0 ms past the 2 ms allowed over 3 "
            "rounds, beyond the rounds' noise)") in out


def test_the_engines_own_gaps_between_tokens_are_read_from_its_metrics() -> None:
    """The paced engine's vllm:inter_token_latency_seconds over a stream: one gap fewer
    than the tokens, each about its interval (it waits that long after each token; under
    uvloop a timer counts whole milliseconds from the loop's cached clock, so one gap can
    come up to a millisecond short)."""
    from bench.path_figures import engine_itl
    from tests.engines import start_fake_engine

    engine = start_fake_engine("gaps", interval_ms=5)
    try:
        before = engine_itl(engine.url)
        assert before is not None
        with httpx.stream("POST", f"{engine.url}/v1/completions", timeout=30, json={
                "model": "fake", "prompt": "x", "max_tokens": 6, "stream": True}) as response:
            assert response.status_code == 200
            assert sum(1 for line in response.iter_lines() if line.startswith("data: {"))
        after = engine_itl(engine.url)
        assert after is not None
        assert after[1] - before[1] == 5
        assert 5 * (0.005 - 0.001) <= after[0] - before[0] < 5 * 0.005 + 1.0
    finally:
        engine.process.kill()
        engine.process.wait(timeout=10)
    assert engine_itl(engine.url) is None  # nothing answers there now


def test_each_path_gets_the_engine_gaps_of_its_own_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import path_figures

    clock = {"gaps": 0, "seconds": 0.0}

    async def one_load(url: str, model: str, streams: int, tokens: int, key: str | None,
                       requests: int) -> Run:
        # The engine's gaps: 10 ms each direct, 11 ms through the relay.
        clock["gaps"] += 9
        clock["seconds"] += 9 * (0.010 if url == "direct" else 0.011)
        return Run([0.01], 10, 1.0, 0)

    monkeypatch.setattr(path_figures, "load", one_load)
    monkeypatch.setattr(path_figures, "engine_itl",
                        lambda url: (clock["seconds"], clock["gaps"]) if url == "engine"
                        else None)
    endpoints = [Endpoint("direct", {"fake": "direct"}, None, {}),
                 Endpoint("relay", {"fake": "relay"}, None, {})]
    direct, relay = path_figures.interleave(path_figures.LOADS["paced-1"], endpoints, 4,
                                            engines={"fake": "engine"})
    assert direct.engine_itl_ms == pytest.approx(10.0)
    assert relay.engine_itl_ms == pytest.approx(11.0)
    plain = path_figures.interleave(path_figures.LOADS["paced-1"], endpoints, 2)
    assert plain[0].engine_itl_ms is None  # no engine given: nothing read
