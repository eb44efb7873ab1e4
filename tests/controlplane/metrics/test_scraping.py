"""What the collector reads of a scrape: vLLM's exposition reduced to the dashboard's
figures."""

from __future__ import annotations

from serving.engine_metrics import parse_metrics
from tests.controlplane.metrics.exposition import text


def test_vllm_exposition_is_reduced_to_the_dashboard_figures() -> None:
    scrape = parse_metrics(text())
    assert scrape.gauges == {"running": 2, "waiting": 1, "kv_cache": 0.25}
    assert scrape.counters["prefix_queries"] == 100
    assert scrape.counters["prefix_hits"] == 40
    assert scrape.counters["finished"] == 4  # summed over finish reasons
    assert scrape.histograms["ttft"] == {0.01: 0, 0.1: 10, 1.0: 10, float("inf"): 10}
