"""Quantiles from histogram buckets, as Prometheus computes them."""

from __future__ import annotations

import pytest

from controlplane.metrics.rates import quantile


def test_quantiles_interpolate_within_buckets_like_prometheus() -> None:
    buckets = {0.01: 0.0, 0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.25, buckets) == pytest.approx(0.055)
    assert quantile(0.75, buckets) == pytest.approx(0.55)
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
