"""Figures derived from Prometheus samples between two scrapes: counter rates, histogram
bucket deltas and their quantiles; sums and means that skip missing figures."""

from __future__ import annotations

import math
from collections.abc import Iterable

SUMMARY_SECONDS = 30.0  # the window of the summaries' rates and quantiles


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (linear within a
    bucket); None when nothing was observed."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (
                (rank - previous_count) / (count - previous_count))
        previous_bound, previous_count = bound, count
    return previous_bound


def bucket_delta(now: dict[float, float], before: dict[float, float] | None
                 ) -> dict[float, float]:
    """What a histogram observed since `before` (all of it after a replica's restart)."""
    if not before:
        return now
    delta = {bound: count - before.get(bound, 0.0) for bound, count in now.items()}
    if any(value < 0 for value in delta.values()):  # the replica restarted
        return now
    return delta


def rate(now: float | None, before: float | None, seconds: float) -> float | None:
    """A counter's increase per second; None when unknown or after a reset."""
    if now is None or before is None or seconds <= 0:
        return None
    if now < before:  # a counter reset: the replica restarted
        return None
    return (now - before) / seconds


def rounded(value: float | None, digits: int = 4) -> float | None:
    """`round`, passing None through."""
    return None if value is None else round(value, digits)


def total(values: Iterable[float | None]) -> float | None:
    """The sum of the figures present; None when none is."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the figures present; None when none is."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
