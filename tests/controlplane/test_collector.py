"""The metrics collector: vLLM's exposition parsed, rates and quantiles derived from
deltas, real scrapes of FAKE engines (fakes/engine.py) registered as replicas, the updates
pushed to the dashboards' channel groups."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from channels.layers import get_channel_layer

from controlplane.autoscaler import figures_from_summary
from controlplane.collector import (
    FLEET_GROUP,
    Collector,
    ReplicaSeries,
    Target,
    deployment_group,
    parse_dcgm,
    quantile,
)
from controlplane.models import Replica
from serving import gateway as _gateway_in_this_process  # noqa: F401  (as in `serve`)
from serving.engine_metrics import parse_metrics
from tests.engines import FakeEngine
from tests.factories import make_backend, make_deployment

# The shape of vLLM's own /metrics (names, labels, _total and _created lines, histograms),
# cut down to a few families and with other families around them.
VLLM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="smollm2"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="smollm2"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="smollm2"}} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="smollm2"}} {queries}
vllm:prefix_cache_queries_created{{engine="0",model_name="smollm2"}} 1.7e9
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="smollm2"}} {hits}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="smollm2"}} {generated}
# TYPE vllm:request_success counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="smollm2"}} 3.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="smollm2"}} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.01",model_name="smollm2"}} {t1}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="smollm2"}} {t2}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="smollm2"}} 1.5
"""


def text(**values: float) -> str:
    defaults = {"running": 2, "waiting": 1, "queries": 100, "hits": 40, "generated": 1000,
                "t1": 0, "t2": 10, "t3": 10}
    return VLLM_TEXT.format(**{**defaults, **values})


def test_vllm_exposition_is_reduced_to_the_dashboard_figures() -> None:
    scrape = parse_metrics(text())
    assert scrape.gauges == {"running": 2, "waiting": 1, "kv_cache": 0.25}
    assert scrape.counters["prefix_queries"] == 100
    assert scrape.counters["prefix_hits"] == 40
    assert scrape.counters["finished"] == 4  # summed over finish reasons
    assert scrape.histograms["ttft"] == {0.01: 0, 0.1: 10, 1.0: 10, float("inf"): 10}


def test_quantiles_interpolate_within_buckets_like_prometheus() -> None:
    buckets = {0.01: 0.0, 0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.25, buckets) == pytest.approx(0.055)
    assert quantile(0.75, buckets) == pytest.approx(0.55)
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_a_series_turns_counter_and_bucket_deltas_into_rates_and_quantiles() -> None:
    series = ReplicaSeries(Target("r1", "demo", "http://x", "active", "ready", None, False),
                           2.0)
    first = series.add(100.0, parse_metrics(text()), {})
    assert first["gen_tps"] is None and first["ttft_p50"] is None  # nothing to compare yet
    assert first["running"] == 2 and first["kv_cache"] == 0.25
    # Two seconds later: 200 more tokens, 50 more prefix queries of which 45 hit, and ten
    # more first tokens, all between 0.1 and 1 s.
    second = series.add(102.0, parse_metrics(text(generated=1200, queries=150, hits=85,
                                                  t2=10, t3=20)), {})
    assert second["gen_tps"] == 100.0
    assert second["prefix_hit_rate"] == 0.9
    assert 0.1 < second["ttft_p50"] < 1.0
    # A restarted replica's counters start again: no negative rate.
    third = series.add(104.0, parse_metrics(text(generated=10, t2=1, t3=1)), {})
    assert third["gen_tps"] is None
    assert series.samples.maxlen is not None and series.samples.maxlen >= 450


def test_dcgm_figures_are_keyed_by_pod() -> None:
    figures = parse_dcgm(
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n1",pod="demo-1"} 87\n'
        "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1",pod="demo-1"} 70000\n')
    assert figures == {"demo-1": {"gpu_util": 87.0, "mem_used_mib": 70000.0}}


@pytest.fixture
def collector_settings(settings: object) -> None:
    settings.SCRAPE_INTERVAL = 0.5  # type: ignore[attr-defined]
    settings.SCRAPE_TIMEOUT = 0.5  # type: ignore[attr-defined]
    settings.CHANNEL_LAYERS = {  # type: ignore[attr-defined]
        "default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


def ready_replica(deployment: Any, name: str, url: str, *, pid: int | None = None
                  ) -> Replica:
    return Replica.objects.create(deployment=deployment, name=name, endpoint=url, pid=pid,
                                  phase=Replica.Phase.READY)


@pytest.mark.django_db(transaction=True)
async def test_a_pass_scrapes_every_live_replica_and_pushes_updates(
        collector_settings: None, fake_engines: Callable[..., FakeEngine]) -> None:
    from asgiref.sync import sync_to_async

    one, two = fake_engines("e1", interval_ms=1), fake_engines("e2", interval_ms=1)

    def arrange() -> None:
        deployment = make_deployment("demo", backend=make_backend("ext", kind="external"),
                                     replicas=2)
        ready_replica(deployment, "demo-1", one.url)
        ready_replica(deployment, "demo-2", two.url)
        Replica.objects.create(deployment=deployment, name="demo-3", endpoint="",
                               phase=Replica.Phase.STARTING)

    await sync_to_async(arrange)()
    layer = get_channel_layer()
    fleet_channel = await layer.new_channel()
    demo_channel = await layer.new_channel()
    await layer.group_add(FLEET_GROUP, fleet_channel)
    await layer.group_add(deployment_group("demo"), demo_channel)
    collector = Collector()
    first = await collector.one_pass()
    assert first["targets"] == 2 and first["scraped"] == 2  # the starting one is skipped
    async with httpx.AsyncClient() as client:  # traffic between the passes
        for _ in range(3):
            await client.post(f"{one.url}/v1/completions", timeout=10, json={
                "model": "fake", "prompt": "hello", "max_tokens": 20})
    await asyncio.sleep(0.3)
    await collector.one_pass()
    fleet = await layer.receive(fleet_channel)  # the first pass's, then the second's
    fleet = await layer.receive(fleet_channel)
    import orjson

    summary = orjson.loads(fleet["text"])["deployments"][0]
    assert summary["name"] == "demo" and summary["ready"] == 2 and summary["desired"] == 2
    assert summary["tokens_per_s"] > 0
    # What the autoscaler reads (controlplane/autoscaler.py) is all there.
    figures = figures_from_summary(summary, time.time(), demand=0, gpu=None)
    assert figures.waiting is not None and figures.running is not None
    assert figures.kv_cache is not None and figures.tokens_per_s is not None
    assert figures.gateway_in_flight == 0  # the gateway is in this process, with nothing
    await layer.receive(demo_channel)
    update = orjson.loads((await layer.receive(demo_channel))["text"])
    assert update["type"] == "update" and update["deployment"] == "demo"
    samples = {r["name"]: r["sample"] for r in update["replicas"]}
    assert samples["demo-1"]["gen_tps"] > 0 and samples["demo-2"]["gen_tps"] == 0
    assert samples["demo-1"]["prefix_hit_rate"] == pytest.approx(2 / 3, abs=0.01)
    history = collector.store.deployment_history("demo")
    assert len(history["replicas"]["demo-1"]["samples"]) == 2
    # The idle replica's figures did not change: its exposition was not parsed again.
    assert collector.parsed_last_pass == 1
    collector.close()


@pytest.mark.django_db(transaction=True)
async def test_a_replica_that_stops_answering_is_a_missing_sample_not_a_failed_pass(
        collector_settings: None, fake_engines: Callable[..., FakeEngine]) -> None:
    from asgiref.sync import sync_to_async

    engine = fake_engines("e1")

    def arrange() -> None:
        deployment = make_deployment("demo", backend=make_backend("ext", kind="external"))
        ready_replica(deployment, "demo-1", engine.url)
        # A local replica: its CPU figures come from its processes (this test's own).
        local = make_deployment("cpu", backend=make_backend("local2"))
        ready_replica(local, "cpu-1", engine.url, pid=os.getpid())

    await sync_to_async(arrange)()
    collector = Collector()
    await collector.one_pass()
    assert collector.store.replicas["cpu-1"].samples[-1]["accelerator"] == "cpu"
    assert collector.store.replicas["cpu-1"].samples[-1]["memory_mib"] > 10
    engine.process.kill()
    engine.process.wait()
    result = await collector.one_pass()
    assert result["targets"] == 2 and result["scraped"] == 0
    assert collector.store.replicas["demo-1"].failures == 1
    assert collector.store.fleet["deployments"][1]["scrape_failures"] == 1
    collector.close()


def test_requests_queued_at_the_gateway_are_counted_per_deployment() -> None:
    from controlplane.collector import GatewayCounters
    from serving import metrics

    metrics.child(metrics.QUEUED, "queued-demo", "batch").set(3)
    metrics.child(metrics.QUEUED, "queued-demo", "critical").set(1)
    metrics.child(metrics.QUEUE_ESTIMATE, "queued-demo").set(1.5)
    try:
        out = GatewayCounters().read(time.time())
        assert out["_queued"]["queued-demo"] == 4  # type: ignore[index]
        assert out["_queue_wait"]["queued-demo"] == 1.5  # type: ignore[index]
    finally:
        metrics.child(metrics.QUEUED, "queued-demo", "batch").set(0)
        metrics.child(metrics.QUEUED, "queued-demo", "critical").set(0)
