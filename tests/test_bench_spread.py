"""The side-by-side table's verdicts say whether a missed target's gap stands out of the
rounds' own scatter (bench/spread.py): per round, the gateway's figure against the
router's in the same round."""

from __future__ import annotations

import math

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


def side(rates: list[float], cpu_per_round: list[float]) -> Side:
    """A path's rounds: each 1000 events in 1000/rate seconds, with this CPU."""
    runs = [Run([0.01], 1000, 1000 / rate, 0) for rate in rates]
    return Side(runs, sum(cpu_per_round), round_cpu=cpu_per_round)


def test_the_verdict_says_whether_a_miss_is_beyond_the_rounds_noise(
        capsys: pytest.CaptureFixture[str]) -> None:
    load = Load("paced-1", "paced 10 ms/token", "fake", 1, 1)
    endpoints = [Endpoint("direct", {}, None, {}), Endpoint("gateway", {}, None, {"fake": 1}),
                 Endpoint(ROUTER, {}, None, {"fake": 2})]
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
    endpoints = [Endpoint("direct", {}, None, {}), Endpoint("gateway", {}, None, {"fake": 1}),
                 Endpoint(ROUTER, {}, None, {"fake": 2})]
    print_table([(load, endpoints, [side([100.0], [0.0]), side([98.0], [0.2]),
                                    side([99.0], [0.1])])], 1)
    out = capsys.readouterr().out
    assert "MISSED (paced-1: 0.9800 against 0.9900)\n" in out
    assert "MISSED (paced-1: 200.0 against 100.0 µs)\n" in out


def test_a_missed_ttft_target_is_judged_past_its_allowance(
        capsys: pytest.CaptureFixture[str]) -> None:
    load = Load("unpaced-64", "unpaced", "fast", 64, 8)
    endpoints = [Endpoint("direct", {}, None, {}), Endpoint("gateway", {}, None, {"fast": 1}),
                 Endpoint(ROUTER, {}, None, {"fast": 2})]

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
