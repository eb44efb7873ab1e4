"""How far apart two paths' per-round figures are, against how much the rounds scatter,
and the side-by-side table's targets judged with it (`check_targets`).

The side-by-side table's rounds are interleaved, so round i of one path and round i of
another ran within seconds of each other on the same machine. Their per-round difference
cancels what moved the whole machine meanwhile; the scatter of those differences over
the rounds says how big a gap one run can tell from noise. `paired` gives the mean
difference and two standard errors of it (with the table's 6 rounds about a 90% interval,
nearer 95% the more rounds); a gap whose interval holds zero is one the run cannot tell
apart from noise."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # bench/path_figures.py imports this module
    from bench.path_figures import Side

# Fewer rounds than this give no spread worth stating.
MIN_ROUNDS = 3
# How far the gateway's added TTFT p50 may exceed the router's (the target).
TTFT_ALLOWANCE_MS = 2.0


@dataclass(frozen=True)
class Paired:
    mean: float  # the mean of a_i - b_i over the rounds
    margin: float  # two standard errors of that mean
    rounds: int

    @property
    def told_apart(self) -> bool:
        """Whether the interval mean ± margin leaves zero out."""
        return abs(self.mean) > self.margin


def paired(a: list[float], b: list[float]) -> Paired | None:
    """The per-round differences a_i - b_i: their mean and two standard errors; None for
    fewer than MIN_ROUNDS pairs or lists of different lengths, or any figure that is not
    a finite number."""
    if len(a) != len(b) or len(a) < MIN_ROUNDS:
        return None
    differences = [x - y for x, y in zip(a, b, strict=True)]
    if not all(math.isfinite(d) for d in differences):
        return None
    n = len(differences)
    mean = sum(differences) / n
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1)
    return Paired(mean, 2 * math.sqrt(variance / n), n)


def describe(result: Paired | None, digits: int, unit: str = "") -> str:
    """`; by round +0.5 ± 9.8 µs over 20 rounds, not told apart from noise`, or nothing
    where there is no spread to state."""
    if result is None:
        return ""
    verdict = "beyond the rounds' noise" if result.told_apart else \
        "not told apart from noise"
    return (f"; by round {result.mean:+.{digits}f} ± {result.margin:.{digits}f}{unit} over "
            f"{result.rounds} rounds, {verdict}")


def check_targets(name: str, direct: Side, gateway: Side, router: Side,
                  misses: dict[str, list[str]]) -> None:
    """Adds this row to `misses` for each target of the gateway it misses."""
    gateway_added = gateway.ttft(0.5) - direct.ttft(0.5)
    router_added = router.ttft(0.5) - direct.ttft(0.5)
    if gateway_added > router_added + TTFT_ALLOWANCE_MS:
        # Per round, the gateway's p50 less the allowance against the router's (direct's
        # p50 of the same round is in both added figures: it cancels).
        spread = paired([p - TTFT_ALLOWANCE_MS for p in round_p50s(gateway)],
                        round_p50s(router))
        allowed = f" ms past the {TTFT_ALLOWANCE_MS:g} ms allowed"
        misses["ttft"].append(f"{name}: {gateway_added:+.1f} against {router_added:+.1f} ms"
                              + describe(spread, 1, allowed))
    if gateway.rate < router.rate:
        spread = paired(*(round_ratios(side, direct) for side in (gateway, router)))
        misses["ratio"].append(f"{name}: {gateway.rate / direct.rate:.4f} against "
                               f"{router.rate / direct.rate:.4f}" + describe(spread, 4))
    if gateway.cpu_per_event_us > router.cpu_per_event_us:
        spread = paired(*(round_cpu_us(side) for side in (gateway, router)))
        misses["cpu"].append(f"{name}: {gateway.cpu_per_event_us:.1f} against "
                             f"{router.cpu_per_event_us:.1f} µs" + describe(spread, 1, " µs"))


def round_p50s(side: Side) -> list[float]:
    """The path's TTFT p50 in each round, in ms."""
    return [run.p(0.5) for run in side.runs]


def round_ratios(side: Side, direct: Side) -> list[float]:
    """The path's throughput ratio to direct in each round, against direct's same round."""
    return [run.rate / plain.rate for run, plain in zip(side.runs, direct.runs, strict=True)]


def round_cpu_us(side: Side) -> list[float]:
    """The path's CPU per relayed event in each round, in µs (none where a round's CPU
    was not kept)."""
    if len(side.round_cpu) != len(side.runs):
        return []
    return [cpu / max(1, run.tokens) * 1e6 for cpu, run in zip(side.round_cpu, side.runs,
                                                                 strict=True)]
