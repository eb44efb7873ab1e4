"""The metrics collector's pass: real scrapes of FAKE engines (fakes/engine.py) registered
as replicas, the updates pushed to the dashboards' channel groups."""

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
from controlplane.collector import Collector
from controlplane.metrics.publishing import FLEET_GROUP, deployment_group
from controlplane.models import Replica
from serving import gateway as _gateway_in_this_process  # noqa: F401  (as in `serve`)
from tests.engines import FakeEngine
from tests.factories import make_backend, make_deployment


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
    # Rates are per second of the time between two passes: that time is the input.
    await asyncio.sleep(0.3)
    await collector.one_pass()
    await layer.receive(fleet_channel)  # the first pass's, then the second's
    fleet = await layer.receive(fleet_channel)
    import orjson

    # The second pass's message: the whole view or (usually) what changed in it.
    message = orjson.loads(fleet["text"])
    summary = (message.get("changed") or message.get("deployments"))[0]
    assert summary["name"] == "demo" and summary["ready"] == 2 and summary["desired"] == 2
    assert summary["tokens_per_s"] > 0
    # What the autoscaler reads (controlplane/autoscaler/) is all there.
    figures = figures_from_summary(summary, time.time(), demand=0, gpu=None)
    assert figures.waiting is not None and figures.running is not None
    assert figures.kv_cache is not None and figures.tokens_per_s is not None
    assert figures.gateway_in_flight == 0  # the gateway is in this process, with nothing
    # Its engine made tokens, but the gateway (in this process) answered no request for
    # it: 0 requests/s and no errors, not unknown.
    assert summary["requests_per_s"] == 0 and summary["error_rate"] == 0
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
