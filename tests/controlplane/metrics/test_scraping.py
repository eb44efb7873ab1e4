"""What the collector reads of a scrape: vLLM's exposition reduced to the dashboard's
figures; the helper process that parses it does not outlive the server."""

from __future__ import annotations

import subprocess
import sys

import psutil

from serving.engine_metrics import parse_metrics
from tests.controlplane.metrics.exposition import text
from tests.processes import ROOT


def test_vllm_exposition_is_reduced_to_the_dashboard_figures() -> None:
    scrape = parse_metrics(text())
    assert scrape.gauges == {"running": 2, "waiting": 1, "kv_cache": 0.25}
    assert scrape.counters["prefix_queries"] == 100
    assert scrape.counters["prefix_hits"] == 40
    assert scrape.counters["finished"] == 4  # summed over finish reasons
    assert scrape.histograms["ttft"] == {0.01: 0, 0.1: 10, 1.0: 10, float("inf"): 10}


PARENT = """
import sys
from controlplane.metrics.scraping import Scraper, parse_batch
scraper = Scraper.__new__(Scraper)
scraper.pool = None
pool = scraper.parser_pool()
pool.submit(parse_batch, []).result(timeout=60)
print(" ".join(str(pid) for pid in pool._processes), flush=True)
sys.stdin.read()
"""


def test_the_parser_process_ends_when_the_server_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert workers
    finally:
        parent.kill()  # as `kill -9`: nothing of the parent's own shutdown runs
        parent.wait(timeout=10)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []
