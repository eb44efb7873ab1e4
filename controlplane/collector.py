"""The metrics collector: scrapes every live replica's /metrics every SCRAPE_INTERVAL
seconds, in parallel and with a timeout, keeps per-replica time series in ring buffers
(the metrics store), and pushes one update per interval to the dashboards' Channels groups.

Per replica and interval: running and waiting requests, KV-cache use, the prefix-cache hit
rate (from counter deltas), TTFT and inter-token latency quantiles (from histogram bucket
deltas), prompt and generation tokens per second, preemptions, finished requests per second;
and the accelerator: DCGM exporter figures when DCGM_EXPORTER_URL is set, else NVML for
local GPUs, else the replica's processes' CPU and memory (psutil), labelled "cpu". The
gateway's in-flight and queued requests, request rate and error rate come from this
process's Prometheus registry, and with REDIS_URL are summed over every gateway process
(serving/figures.py, read by controlplane/metrics/gateway_figures.py).

This module runs the pass and keeps the collector of this process (`current`); the parts
live in controlplane/metrics/. The message schema pushed to browsers is documented in
docs/dashboards.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from controlplane.metrics.accelerators import Accelerators, parse_dcgm
from controlplane.metrics.gateway_figures import GatewayCounters
from controlplane.metrics.publishing import FLEET_GROUP, deployment_group, publish
from controlplane.metrics.rates import quantile
from controlplane.metrics.scraping import Scraper
from controlplane.metrics.store import (
    GatewayReading,
    MetricsStore,
    ReplicaSeries,
    ScalingDecision,
)
from controlplane.metrics.targets import Target, TargetCache
from controlplane.outages import DatabaseOutage
from controlplane.wakeups import figures_collected
from serving.wakeup import until_beat

# Imported from here by the consumers, the controllers, the autoscaler and their tests.
__all__ = ["FLEET_GROUP", "Collector", "GatewayCounters", "MetricsStore", "ReplicaSeries",
           "ScalingDecision", "Target", "current", "deployment_group", "parse_dcgm",
           "quantile", "run_collector"]

logger = logging.getLogger(__name__)

NO_COUNTS = {"desired": 0, "ready": 0, "standby": 0}


class Collector:
    """Scrapes, stores and publishes the replicas' metrics, one pass per interval."""

    def __init__(self, interval: float | None = None) -> None:
        self.interval = interval if interval is not None else float(
            settings.SCRAPE_INTERVAL)
        self.timeout = min(float(settings.SCRAPE_TIMEOUT), self.interval)
        self.store = MetricsStore(self.interval)
        self.scraper = Scraper(self.store, self.timeout)
        self.accelerators = Accelerators()
        self.gateway_counters = GatewayCounters()
        self.targets = TargetCache()

    @property
    def parsed_last_pass(self) -> int:
        """Expositions parsed in the last pass (the changed ones)."""
        return self.scraper.parsed_last_pass

    async def one_pass(self) -> dict[str, Any]:
        """Scrape every live replica, add the samples and summaries to the store, push
        them to the dashboards; what the pass did, and how long it took."""
        started = time.perf_counter()
        # Read on a thread only when the reconciler may have changed them.
        kept = self.targets.kept()
        targets, deployments = kept if kept is not None else await sync_to_async(
            self.targets.load, thread_sensitive=False)()
        scrapes = await self.scraper.scrape_all(targets)
        accelerators = await self.accelerators.figures(targets, self.scraper.fetch)
        at = time.time()
        # With the gateway in this process (`manage.py serve`), a deployment it has no
        # request for has 0 in flight; with the gateway elsewhere the figure is unknown.
        gateway = GatewayReading.from_counters(
            self.gateway_counters.read(at),
            idle=0.0 if "serving.gateway" in sys.modules else None)
        store = self.store
        added, failing = store.add_pass(at, targets, scrapes, accelerators)
        per_deployment: dict[str, list[dict[str, Any]]] = {
            **{name: [] for name in deployments}, **added}
        store.forget({t.name for t in targets}, set(deployments))
        updates = {name: store.summarise(at, name, per_deployment[name],
                                         deployments.get(name, dict(NO_COUNTS)), gateway,
                                         failing.get(name, 0))
                   for name in sorted(per_deployment)}
        store.fleet = {"type": "fleet", "t": round(at, 3),
                       "deployments": [update["summary"] for update in updates.values()]}
        store.last_pass_seconds = time.perf_counter() - started
        await publish(store.fleet, updates)
        return {"targets": len(targets),
                "scraped": sum(len(replicas) for replicas in added.values()),
                "parsed": self.parsed_last_pass,
                "seconds": store.last_pass_seconds}

    async def run(self, stop: asyncio.Event) -> None:
        """One pass every interval, on the loop's beat (serving/wakeup.py: with the other
        periodic work), until `stop` is set; a failed pass is logged. A pass that ran
        past its next beat waits for the one after rather than catching up."""
        logger.info("metrics collector running (every %.1f s)", self.interval)
        outage = DatabaseOutage("metrics", logger)
        while not stop.is_set():
            try:
                await self.one_pass()
                outage.succeeded()
            except Exception as error:
                outage.failed(error)
            figures_collected.set()  # the autoscaler decides on this pass's figures
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=until_beat(self.interval))
        self.close()

    def close(self) -> None:
        """Close the scraper's connections and its parser process."""
        self.scraper.close()


collector: Collector | None = None


def current() -> Collector | None:
    """The collector running in this process, if any (the dashboards read its store)."""
    return collector


async def run_collector(stop: asyncio.Event) -> None:
    """Run this process's collector until `stop` is set."""
    global collector
    collector = Collector()
    # The reconciler runs beside it (controllers.py): targets are read again after its
    # passes change something, not on every scrape.
    collector.targets = TargetCache(follows_reconciler=True)
    await collector.run(stop)
