"""What the collector reads of a scrape: vLLM's exposition reduced to the dashboard's
figures, read line by line as prometheus-client's parser reads it; a small fleet's
parsed without a helper process, and the helper process that parses a large one's does not
outlive the server."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from controlplane.metrics.scraping import Scraper, parse_batch
from serving.engine_metrics import parse_metrics, parse_reduced, reduce_exposition
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


CLOSING = """
import sys
from controlplane.metrics.scraping import Scraper, parse_batch
class NoClient:
    def close(self):
        pass
scraper = Scraper.__new__(Scraper)
scraper.pool, scraper.client = None, NoClient()
pool = scraper.parser_pool()
pool.submit(parse_batch, []).result(timeout=60)
print(" ".join(str(pid) for pid in pool._processes), flush=True)
scraper.close()  # as the collector does when the server stops
print("closed", flush=True)
sys.stdin.read()
"""


def parent_with_parser(script: str) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """`script` run in a process of its own, and the parser workers it prints."""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert workers
    except BaseException:
        parent.kill()
        parent.wait(timeout=10)
        raise
    return parent, workers


def test_the_parser_process_ends_when_the_collector_closes() -> None:
    parent, workers = parent_with_parser(CLOSING)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "closed"
        # The parent lives on: the workers end because the scraper closed, not with it.
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [] and parent.poll() is None
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_the_parser_process_ends_when_the_server_is_killed() -> None:
    parent, workers = parent_with_parser(PARENT)
    parent.kill()  # as `kill -9`: nothing of the parent's own shutdown runs
    parent.wait(timeout=10)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []


def prometheus_reading(reduced: str) -> tuple[dict[str, float], dict[str, float],
                                              dict[str, dict[float, float]]]:
    """What prometheus-client's own parser reads in a reduced exposition, summed as the
    collector sums it: the reference parse_reduced is held to."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.engine_metrics import COUNTERS, GAUGES, HISTOGRAMS

    gauges: dict[str, float] = {}
    older: dict[str, float] = {}
    counters: dict[str, float] = {}
    histograms: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(reduced):
        for sample in family.samples:
            name = sample.name
            if name in GAUGES:
                into = older if name == "vllm:gpu_cache_usage_perc" else gauges
                into[GAUGES[name]] = into.get(GAUGES[name], 0.0) + sample.value
            elif name.endswith("_total") and name[:-6] in COUNTERS:
                key = COUNTERS[name[:-6]]
                counters[key] = counters.get(key, 0.0) + sample.value
            elif name.endswith("_bucket") and name[:-7] in HISTOGRAMS:
                key = ("_older" if name.startswith("vllm:time_per_output")
                       else HISTOGRAMS[name[:-7]])
                buckets = histograms.setdefault(key, {})
                bound = float(sample.labels.get("le", "inf"))
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    for key, value in older.items():
        gauges.setdefault(key, value)
    fallback = histograms.pop("_older", None)
    if fallback is not None:
        histograms.setdefault("itl", fallback)
    return gauges, counters, histograms


OLDER_NAMES = """\
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.05",model_name="m"} 3.0 1700000000000
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7
vllm:num_requests_running{engine="0",model_name="m"} 1e1
vllm:num_requests_running{engine="1",model_name="m"} 2.5
vllm:prompt_tokens_total{engine="0",model_name="m"} NaN
vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m"} 4
"""


@pytest.mark.parametrize("exposition", [
    text(), text(running=7, waiting=0, t1=2, t2=5, t3=9, generated=1.5e6), OLDER_NAMES,
    text() + OLDER_NAMES,
])
def test_reduced_expositions_read_as_prometheus_client_reads_them(exposition: str) -> None:
    reduced = reduce_exposition(exposition)
    scrape = parse_reduced(reduced)
    gauges, counters, histograms = prometheus_reading(reduced)
    assert scrape.gauges == gauges
    assert scrape.histograms == histograms
    # NaN is not equal to itself: compared as text.
    assert {k: repr(v) for k, v in scrape.counters.items()} == \
        {k: repr(v) for k, v in counters.items()}


@pytest.mark.parametrize("line", [
    'vllm:num_requests_running{engine="0"} 1',  # a label the reduction drops
    "vllm:num_requests_running",  # no value
    "vllm:num_requests_running 1 2 3",
    "vllm:num_requests_running one",
    'vllm:time_to_first_token_seconds_bucket{le="0.1" 1',  # no closing brace
])
def test_a_line_that_is_not_a_reduced_sample_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse_reduced(line + "\n")
    # In a pass, that replica's figures are missing; the others are read.
    assert parse_batch([line + "\n", reduce_exposition(text())])[0] is None
    assert parse_batch([line + "\n", reduce_exposition(text())])[1] is not None


@pytest.mark.django_db(transaction=True)
async def test_a_small_fleets_expositions_are_parsed_without_a_worker_process() -> None:
    from controlplane.metrics.scraping import INLINE_PARSES
    from controlplane.metrics.store import MetricsStore
    from controlplane.metrics.targets import Target

    scraper = Scraper(MetricsStore(2.0), 1.0)
    targets = [Target(f"r{i}", "demo", "http://127.0.0.1:9", "primary", "ready", None,
                      False) for i in range(INLINE_PARSES)]
    for target, running in zip(targets, range(INLINE_PARSES), strict=True):
        scraper.batch.append((target, reduce_exposition(text(running=running))))
    texts: list[str | None] = [text for _, text in scraper.batch]
    try:
        scrapes = await scraper.parse_all(targets, texts)
        assert [s.gauges["running"] if s else None for s in scrapes] == \
            list(range(INLINE_PARSES))
        assert scraper.parsed_last_pass == INLINE_PARSES
        assert scraper.pool is None  # nothing handed over, no process started
        # Unchanged next pass: the parses kept are given again, nothing parsed.
        assert await scraper.parse_all(targets, texts) == scrapes
        assert scraper.parsed_last_pass == 0
    finally:
        scraper.close()
