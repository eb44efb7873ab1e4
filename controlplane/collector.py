"""The metrics collector: scrapes every live replica's /metrics every SCRAPE_INTERVAL
seconds, in parallel and with a timeout, keeps per-replica time series in ring buffers
(the metrics store), and pushes one update per interval to the dashboards' Channels groups.

Per replica and interval: running and waiting requests, KV-cache use, the prefix-cache hit
rate (from counter deltas), TTFT and inter-token latency quantiles (from histogram bucket
deltas), prompt and generation tokens per second, preemptions, finished requests per second;
and the accelerator: DCGM exporter figures when DCGM_EXPORTER_URL is set, else NVML for
local GPUs, else the replica's processes' CPU and memory (psutil), labelled "cpu". The
gateway's own in-flight requests, request rate and error rate come from this process's
Prometheus registry (the gateway runs here in the embedded setup).

The message schema pushed to browsers is documented in docs/dashboards.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from serving.engine_metrics import (
    Scrape,
    parse_reduced,
    reduce_exposition,
)
from serving.sealing import SealError, unseal

logger = logging.getLogger(__name__)

HISTORY_SECONDS = 15 * 60
SUMMARY_SECONDS = 30.0  # the window of the summaries' rates and quantiles
PARSE_BATCH = 32  # expositions handed to the parser process at a time
FLEET_GROUP = "dashboard.fleet"

DCGM = {
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
}



def parse_batch(texts: list[str]) -> list[Scrape | None]:
    """Parse reduced expositions (in the parser's worker process)."""
    out: list[Scrape | None] = []
    for text in texts:
        try:
            out.append(parse_reduced(text))
        except Exception:
            out.append(None)
    return out


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
    if not before:
        return now
    delta = {bound: count - before.get(bound, 0.0) for bound, count in now.items()}
    if any(value < 0 for value in delta.values()):  # the replica restarted
        return now
    return delta


def rate(now: float | None, before: float | None, seconds: float) -> float | None:
    if now is None or before is None or seconds <= 0:
        return None
    if now < before:  # a counter reset: the replica restarted
        return None
    return (now - before) / seconds


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def scrape_key(kind: str, config: dict[str, Any] | None, sealed: str) -> str:
    """The bearer token a replica's /metrics wants (Deployment.upstream_key, from the
    columns a values() query read)."""
    if kind == "external":
        return str((config or {}).get("api_key") or "")
    try:
        return unseal(sealed)
    except SealError:
        return ""


@dataclass
class Target:
    name: str
    deployment: str
    url: str
    role: str
    phase: str
    pid: int | None
    local: bool
    #: Sent as `Authorization: Bearer` (the engine key; an external endpoint's own key).
    key: str = field(default="", repr=False)


class ReplicaSeries:
    """A replica's samples over the last HISTORY_SECONDS, oldest first."""

    def __init__(self, target: Target, interval: float) -> None:
        self.target = target
        self.samples: deque[dict[str, Any]] = deque(
            maxlen=max(450, math.ceil(HISTORY_SECONDS / interval) + 1))
        self.last: Scrape | None = None
        self.last_at = 0.0
        self.failures = 0
        self.window: deque[tuple[float, Scrape]] = deque()
        self.last_text = ""  # the reduced exposition last parsed, and its result:
        self.last_parsed: Scrape | None = None  # an idle replica's is not parsed again

    def add(self, at: float, scrape: Scrape, accelerator: dict[str, Any]) -> dict[str, Any]:
        previous, seconds = self.last, at - self.last_at
        sample: dict[str, Any] = {
            "t": round(at, 3),
            "running": scrape.gauges.get("running"),
            "waiting": scrape.gauges.get("waiting"),
            "kv_cache": rounded(scrape.gauges.get("kv_cache")),
        }
        before = previous.counters if previous else {}
        for key, name in (("prompt_tokens", "prompt_tps"), ("generation_tokens", "gen_tps"),
                          ("finished", "finished_rps"), ("preemptions", "preemptions_ps")):
            sample[name] = rounded(rate(scrape.counters.get(key), before.get(key), seconds), 3)
        queries = rate(scrape.counters.get("prefix_queries"), before.get("prefix_queries"),
                       seconds)
        hits = rate(scrape.counters.get("prefix_hits"), before.get("prefix_hits"), seconds)
        sample["prefix_hit_rate"] = (rounded(hits / queries) if queries and hits is not None
                                     else None)
        for key in ("ttft", "itl"):
            now_buckets = scrape.histograms.get(key)
            if now_buckets is None or previous is None:
                sample[f"{key}_p50"] = sample[f"{key}_p95"] = None
                continue
            delta = bucket_delta(now_buckets, previous.histograms.get(key))
            sample[f"{key}_p50"] = rounded(quantile(0.5, delta), 5)
            sample[f"{key}_p95"] = rounded(quantile(0.95, delta), 5)
        sample.update(accelerator)
        self.last, self.last_at = scrape, at
        self.window.append((at, scrape))
        while len(self.window) > 2 and self.window[1][0] <= at - SUMMARY_SECONDS:
            self.window.popleft()
        self.samples.append(sample)
        return sample


def window_figures(series: list[ReplicaSeries]) -> dict[str, float | None]:
    """Tokens per second and TTFT quantiles of these replicas over the summary window
    (their histograms summed, so the quantiles are the deployment's, not an average)."""
    tokens = 0.0
    seconds = 0.0
    counted = False
    merged: dict[float, float] = {}
    for one in series:
        if len(one.window) < 2:
            continue
        (start, first), (end, last) = one.window[0], one.window[-1]
        generated = rate(last.counters.get("generation_tokens"),
                         first.counters.get("generation_tokens"), end - start)
        if generated is not None:
            tokens += generated
            counted = True
        seconds = max(seconds, end - start)
        now = last.histograms.get("ttft")
        if now:
            for bound, count in bucket_delta(now, first.histograms.get("ttft")).items():
                merged[bound] = merged.get(bound, 0.0) + count
    return {"tokens_per_s": round(tokens, 2) if counted else None,
            "ttft_p50": rounded(quantile(0.5, merged), 5),
            "ttft_p95": rounded(quantile(0.95, merged), 5)}


class GatewayCounters:
    """The gateway's counters, as per-deployment rates between two passes: this process's,
    and with REDIS_URL every gateway process's, summed (serving/figures.py)."""

    def __init__(self) -> None:
        from serving.figures import FleetFigures

        self.fleet = FleetFigures()
        self.last: dict[str, tuple[float, float]] = {}
        self.last_at = 0.0
        self.window: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()

    def read(self, at: float) -> dict[str, dict[str, float | None]]:
        """Request and error rates per deployment (since the last pass, and over the
        summary window), with the in-flight, queued and queue-wait figures under
        `_in_flight`, `_queued` and `_queue_wait`."""
        figures = self.fleet.read(settings.REDIS_URL or None, at)
        totals = figures.requests
        seconds = at - self.last_at
        out: dict[str, dict[str, float | None]] = {}
        for deployment, (count, errors) in totals.items():
            before = self.last.get(deployment)
            requests = rate(count, before[0] if before else None, seconds)
            failed = rate(errors, before[1] if before else None, seconds)
            out[deployment] = {
                "requests_per_s": rounded(requests, 3),
                "error_rate": rounded(failed / requests) if requests and failed is not None
                else (0.0 if requests == 0 else None)}
        self.last = {deployment: (count, errors) for deployment, (count, errors)
                     in totals.items()}
        self.last_at = at
        self.window.append((at, self.last))
        while len(self.window) > 2 and self.window[1][0] <= at - SUMMARY_SECONDS:
            self.window.popleft()
        start, oldest = self.window[0]
        for deployment, (count, errors) in self.last.items():
            before = oldest.get(deployment, (0.0, 0.0)) if start < at else None
            requests = rate(count, before[0] if before else None, at - start)
            failed = rate(errors, before[1] if before else None, at - start)
            out.setdefault(deployment, {})["window_requests_per_s"] = rounded(requests, 3)
            out[deployment]["window_error_rate"] = (
                rounded(failed / requests) if requests and failed is not None
                else (0.0 if requests == 0 else None))
        out["_in_flight"] = dict(figures.in_flight)  # type: ignore[assignment]
        out["_queued"] = dict(figures.queued)  # type: ignore[assignment]
        out["_queue_wait"] = dict(figures.queue_wait)  # type: ignore[assignment]
        return out


def cpu_figures(pids: Iterable[int], cache: dict[int, Any]) -> dict[str, Any]:
    """CPU percent (of one core) and resident memory of a replica's process group."""
    import psutil

    cpu = 0.0
    rss = 0
    seen = False
    for pid in pids:
        try:
            process = cache.get(pid)
            if process is None:
                process = cache[pid] = psutil.Process(pid)
                process.cpu_percent(None)  # the first call only starts the measurement
            cpu += process.cpu_percent(None)
            rss += process.memory_info().rss
            seen = True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            cache.pop(pid, None)
    if not seen:
        return {"accelerator": "cpu"}
    return {"accelerator": "cpu", "cpu_percent": round(cpu, 1),
            "memory_mib": round(rss / 2**20, 1)}


def process_group(pid: int) -> list[int]:
    """The replica's process and its children (vLLM's engine core is a child)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        return [pid] + [child.pid for child in parent.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class Nvml:
    """Local GPUs through NVML (the nvidia-ml-py package), when it loads."""

    def __init__(self) -> None:
        self.ready = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.ready = self.count > 0
        except Exception:
            self.ready = False

    def figures(self, pids: set[int]) -> dict[str, Any] | None:
        """The GPUs running any of these processes, summed (utilisation averaged)."""
        if not self.ready:
            return None
        nvml = self.nvml
        used = free = power = 0.0
        utils: list[float] = []
        temps: list[float] = []
        for index in range(self.count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            running = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            if not running & pids:
                continue
            utils.append(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used += memory.used / 2**20
            free += memory.free / 2**20
            with contextlib.suppress(Exception):
                power += nvml.nvmlDeviceGetPowerUsage(handle) / 1000
            with contextlib.suppress(Exception):
                temps.append(nvml.nvmlDeviceGetTemperature(handle, 0))
        if not utils:
            return None
        return {"accelerator": "gpu", "gpu_util": round(sum(utils) / len(utils), 1),
                "mem_used_mib": round(used), "mem_free_mib": round(free),
                "power_w": round(power, 1), "temperature_c": max(temps) if temps else None}


def parse_dcgm(text: str) -> dict[str, dict[str, float]]:
    """DCGM exporter figures keyed by the pod (Kubernetes) or the host, else "gpu<N>"."""
    out: dict[str, dict[str, float]] = {}
    kept = "\n".join(line for line in text.splitlines()
                     if line.startswith(tuple(DCGM)) or line.startswith("# TYPE DCGM_"))
    for family in text_string_to_metric_families(kept + "\n"):
        key = DCGM.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            owner = (labels.get("pod") or labels.get("exported_pod")
                     or labels.get("Hostname") or f"gpu{labels.get('gpu', '?')}")
            out.setdefault(owner, {})[key] = sample.value
    return out


class MetricsStore:
    """Every replica's series, the gateway's, and the fleet summary of the last pass."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.replicas: dict[str, ReplicaSeries] = {}
        self.gateway: dict[str, deque[dict[str, Any]]] = {}
        self.fleet: dict[str, Any] = {"type": "fleet", "at": None, "deployments": []}
        self.last_pass_seconds = 0.0

    def series(self, target: Target) -> ReplicaSeries:
        series = self.replicas.get(target.name)
        if series is None:
            series = self.replicas[target.name] = ReplicaSeries(target, self.interval)
        series.target = target
        return series

    def gateway_series(self, deployment: str) -> deque[dict[str, Any]]:
        series = self.gateway.get(deployment)
        if series is None:
            series = self.gateway[deployment] = deque(
                maxlen=max(450, math.ceil(HISTORY_SECONDS / self.interval) + 1))
        return series

    def forget(self, live: set[str], deployments: set[str]) -> None:
        for name in set(self.replicas) - live:
            del self.replicas[name]
        for name in set(self.gateway) - deployments:
            del self.gateway[name]

    def deployment_history(self, deployment: str) -> dict[str, Any]:
        """Everything kept for one deployment: sent when a dashboard connects."""
        return {"type": "history", "deployment": deployment, "interval": self.interval,
                "replicas": {name: {"role": s.target.role, "samples": list(s.samples)}
                             for name, s in sorted(self.replicas.items())
                             if s.target.deployment == deployment},
                "gateway": list(self.gateway.get(deployment, ()))}


def total(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


class Collector:
    def __init__(self, interval: float | None = None) -> None:
        from serving.upstream import Pool

        self.interval = interval if interval is not None else float(
            settings.SCRAPE_INTERVAL)
        self.timeout = min(float(settings.SCRAPE_TIMEOUT), self.interval)
        self.store = MetricsStore(self.interval)
        self.client = Pool()
        self.gateway_counters = GatewayCounters()
        self.processes: dict[int, Any] = {}
        self.nvml: Nvml | None = None
        self.concurrency = asyncio.Semaphore(128)
        self.parsed_last_pass = 0
        self.batch: list[tuple[Target, str]] = []
        self.parsing: list[tuple[list[tuple[Target, str]], asyncio.Future[Any]]] = []
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None

    # --- targets -----------------------------------------------------------------------

    @staticmethod
    def load_targets() -> tuple[list[Target], dict[str, dict[str, int]]]:
        from django.db import close_old_connections

        from controlplane.models import Deployment, Replica

        close_old_connections()
        deployments = {d.name: {"desired": d.desired_replicas(), "ready": 0, "standby": 0}
                       for d in Deployment.objects.filter(deleting=False)}
        targets = []
        keys: dict[str, str] = {}
        live = (Replica.Phase.READY, Replica.Phase.DRAINING)
        for row in Replica.objects.filter(phase__in=live).exclude(endpoint="").values(
                "name", "deployment__name", "endpoint", "role", "phase", "pid",
                "deployment__backend__kind", "deployment__backend__config",
                "deployment__engine_key_sealed"):
            deployment = row["deployment__name"]
            counts = deployments.setdefault(deployment, {"desired": 0, "ready": 0,
                                                         "standby": 0})
            if row["phase"] == Replica.Phase.READY:
                counts["standby" if row["role"] == "standby" else "ready"] += 1
            if deployment not in keys:
                keys[deployment] = scrape_key(row["deployment__backend__kind"],
                                              row["deployment__backend__config"],
                                              row["deployment__engine_key_sealed"])
            targets.append(Target(row["name"], deployment, row["endpoint"], row["role"],
                                  row["phase"], row["pid"],
                                  row["deployment__backend__kind"] == "local",
                                  keys[deployment]))
        return targets, deployments

    # --- scraping ----------------------------------------------------------------------

    async def fetch(self, url: str, path: str, key: str = "") -> str:
        headers = (("Authorization", f"Bearer {key}"),) if key else ()
        async with self.concurrency, asyncio.timeout(self.timeout):
            return await self.client.get_text(url, path, headers)

    async def scrape(self, target: Target) -> str | None:
        """The replica's exposition, reduced; None when the scrape fails. A changed one is
        queued for parsing at once, so parsing runs beside the scrapes still in flight."""
        try:
            text = reduce_exposition(await self.fetch(target.url, "/metrics", target.key))
        except Exception as exc:  # any failure is one missing sample, never a crash
            logger.debug("scrape of %s failed: %s", target.name, exc)
            return None
        series = self.store.replicas.get(target.name)
        if series is None or series.last_parsed is None or series.last_text != text:
            self.batch.append((target, text))
            if len(self.batch) >= PARSE_BATCH:
                self.submit_batch()
        return text

    def submit_batch(self) -> None:
        batch, self.batch = self.batch, []
        if not batch:
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.parser_pool(), parse_batch, [t for _, t in batch])
        self.parsing.append((batch, future))

    def parser_pool(self) -> concurrent.futures.Executor:
        """A worker process: parsing hundreds of expositions holds an interpreter for a
        while, and in the embedded setup the gateway shares this one."""
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    async def parse_all(self, targets: list[Target], texts: list[str | None]
                        ) -> list[Scrape | None]:
        """The pass's parsed expositions: the changed ones from the parser, the rest the
        same as at the replica's last scrape."""
        self.submit_batch()
        parsed: dict[str, Scrape | None] = {}
        changed = 0
        for batch, future in self.parsing:
            try:
                results = await future
            except Exception as exc:  # a broken worker: this pass's changes are missing
                logger.warning("parsing metrics failed: %s", exc)
                self.pool = None
                results = [None] * len(batch)
            for (target, reduced), scrape in zip(batch, results, strict=True):
                parsed[target.name] = scrape
                changed += 1
                if scrape is not None:
                    kept = self.store.series(target)
                    kept.last_text, kept.last_parsed = reduced, scrape
        self.parsing = []
        self.parsed_last_pass = changed
        out: list[Scrape | None] = []
        for target, text in zip(targets, texts, strict=True):
            if text is None:
                out.append(None)
            elif target.name in parsed:
                out.append(parsed[target.name])
            else:
                series = self.store.replicas.get(target.name)
                out.append(series.last_parsed if series is not None else None)
        return out

    async def accelerator_figures(self, targets: list[Target]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if settings.DCGM_EXPORTER_URL:
            try:
                base, _, path = str(settings.DCGM_EXPORTER_URL).partition("://")
                host, _, rest = path.partition("/")
                by_owner = parse_dcgm(await self.fetch(f"{base}://{host}", "/" + rest))
            except Exception as exc:
                logger.debug("DCGM exporter scrape failed: %s", exc)
                by_owner = {}
            for target in targets:
                figures = by_owner.get(target.name)
                if figures:
                    out[target.name] = {"accelerator": "gpu", **figures}
            if by_owner:
                return out
        local = [t for t in targets if t.local and t.pid]
        if not local:
            return out
        if self.nvml is None:
            self.nvml = await asyncio.to_thread(Nvml)
        groups = {t.name: process_group(t.pid) for t in local if t.pid}
        for target in local:
            pids = groups.get(target.name) or []
            gpu = self.nvml.figures(set(pids)) if self.nvml.ready else None
            out[target.name] = gpu or cpu_figures(pids, self.processes)
        return out

    async def one_pass(self) -> dict[str, Any]:
        started = time.perf_counter()
        targets, deployments = await sync_to_async(self.load_targets,
                                                   thread_sensitive=False)()
        texts = await asyncio.gather(*(self.scrape(t) for t in targets))
        scrapes = await self.parse_all(targets, list(texts))
        accelerators = await self.accelerator_figures(targets)
        at = time.time()
        gateway = self.gateway_counters.read(at)
        in_flight: dict[str, float] = gateway.pop("_in_flight", {})  # type: ignore[assignment]
        queued: dict[str, float] = gateway.pop("_queued", {})  # type: ignore[assignment]
        queue_wait: dict[str, float] = gateway.pop("_queue_wait", {})  # type: ignore[assignment]
        # With the gateway in this process (`manage.py serve`), a deployment it has no
        # request for has 0 in flight; with the gateway elsewhere the figure is unknown.
        idle_gateway = 0.0 if "serving.gateway" in sys.modules else None
        store = self.store
        per_deployment: dict[str, list[dict[str, Any]]] = {name: [] for name in deployments}
        latest_samples: dict[str, dict[str, Any]] = {}
        failing: dict[str, int] = {}
        for target, scrape in zip(targets, scrapes, strict=True):
            series = store.series(target)
            if scrape is None:
                series.failures += 1
                failing[target.deployment] = failing.get(target.deployment, 0) + 1
                continue
            series.failures = 0
            sample = series.add(at, scrape, accelerators.get(target.name, {}))
            latest_samples[target.name] = sample
            per_deployment.setdefault(target.deployment, []).append(
                {"name": target.name, "role": target.role, "phase": target.phase,
                 "sample": sample})
        store.forget({t.name for t in targets}, set(deployments))
        summaries = []
        updates: dict[str, dict[str, Any]] = {}
        for name in sorted(per_deployment):
            replicas = per_deployment[name]
            samples = [r["sample"] for r in replicas if r["role"] != "standby"]
            gate = gateway.get(name, {})
            counts = deployments.get(name, {"desired": 0, "ready": 0, "standby": 0})
            # The deployment's own series: the gateway's figures and the replica counts
            # (the autoscaler's decisions, charted on the deployment's dashboard).
            gateway_sample = {"t": round(at, 3), "requests_per_s": gate.get("requests_per_s"),
                              "error_rate": gate.get("error_rate"),
                              "in_flight": in_flight.get(name, idle_gateway),
                              "queued": queued.get(name, idle_gateway),
                              "queue_wait_s": queue_wait.get(name, idle_gateway),
                              "desired": counts["desired"],
                              "ready": counts["ready"], "standby": counts["standby"]}
            store.gateway_series(name).append(gateway_sample)
            window = window_figures([store.replicas[r["name"]] for r in replicas
                                     if r["role"] != "standby"])
            waiting = total(s.get("waiting") for s in samples)
            running = total(s.get("running") for s in samples)
            summary = {
                "name": name, "ready": counts["ready"], "desired": counts["desired"],
                "standby": counts["standby"],
                "window_seconds": SUMMARY_SECONDS,
                "requests_per_s": gate.get("window_requests_per_s"),
                "in_flight": in_flight.get(name, idle_gateway),
                "queued": queued.get(name, idle_gateway),
                "queue_wait_s": queue_wait.get(name, idle_gateway),
                "tokens_per_s": window["tokens_per_s"],
                "waiting": waiting, "running": running,
                "kv_cache": rounded(mean(s.get("kv_cache") for s in samples)),
                "ttft_p50": window["ttft_p50"], "ttft_p95": window["ttft_p95"],
                "error_rate": gate.get("window_error_rate"),
                "scrape_failures": failing.get(name, 0),
            }
            summaries.append(summary)
            updates[name] = {"type": "update", "deployment": name, "t": round(at, 3),
                             "summary": summary, "gateway": gateway_sample,
                             "replicas": replicas}
        store.fleet = {"type": "fleet", "t": round(at, 3), "deployments": summaries}
        store.last_pass_seconds = time.perf_counter() - started
        await self.publish(updates)
        return {"targets": len(targets), "scraped": len(latest_samples),
                "parsed": self.parsed_last_pass,
                "seconds": store.last_pass_seconds}

    async def publish(self, updates: dict[str, dict[str, Any]]) -> None:
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is None:
            return
        try:
            # Serialised once here, not once per socket.
            await layer.group_send(FLEET_GROUP, {"type": "dashboard.message",
                                                 "text": orjson.dumps(self.store.fleet).decode()})
            for name, update in updates.items():
                await layer.group_send(deployment_group(name),
                                       {"type": "dashboard.message",
                                        "text": orjson.dumps(update).decode()})
        except Exception:
            logger.exception("publishing dashboard updates failed")

    async def run(self, stop: asyncio.Event) -> None:
        logger.info("metrics collector running (every %.1f s)", self.interval)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not stop.is_set():
            try:
                await self.one_pass()
            except Exception:
                logger.exception("metrics pass failed")
            next_at += self.interval
            delay = next_at - loop.time()
            if delay < 0:  # a slow pass: start again from now rather than catch up
                next_at, delay = loop.time(), 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
        self.close()

    def close(self) -> None:
        self.client.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def deployment_group(name: str) -> str:
    return f"dashboard.deployment.{name}"


collector: Collector | None = None


def current() -> Collector | None:
    """The collector running in this process, if any (the dashboards read its store)."""
    return collector


async def run_collector(stop: asyncio.Event) -> None:
    global collector
    collector = Collector()
    await collector.run(stop)
