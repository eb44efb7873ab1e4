"""How far apart two paths' per-round figures are, against how much the rounds scatter.

The side-by-side table's rounds are interleaved, so round i of one path and round i of
another ran within seconds of each other on the same machine. Their per-round difference
cancels what moved the whole machine meanwhile; the scatter of those differences over
the rounds says how big a gap one run can tell from noise. `paired` gives the mean
difference and two standard errors of it (about a 95% interval for a handful of rounds
or more); a gap whose interval holds zero is one the run cannot tell apart from noise."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fewer rounds than this give no spread worth stating.
MIN_ROUNDS = 3


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
