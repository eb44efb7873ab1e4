"""The metrics store: each replica's samples over the last HISTORY_SECONDS in ring
buffers, each deployment's own series (the gateway's figures, the replica counts and the
autoscaler's decisions), and the summaries of the last pass that the dashboards and the
autoscaler read."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.metrics.rates import (
    SUMMARY_SECONDS,
    bucket_delta,
    mean,
    quantile,
    rate,
    rounded,
    total,
)

if TYPE_CHECKING:
    from controlplane.metrics.targets import Target
    from serving.engine_metrics import Scrape

HISTORY_SECONDS = 15 * 60
# What a decision keeps of each of its signals (docs/autoscaling.md).
CHARTED_SIGNAL_FIGURES = ("value", "target", "proposes")


def history_length(interval: float) -> int:
    """Samples kept per series: HISTORY_SECONDS of them, and at least 450."""
    return max(450, math.ceil(HISTORY_SECONDS / interval) + 1)


class ReplicaSeries:
    """A replica's samples over the last HISTORY_SECONDS, oldest first."""

    def __init__(self, target: Target, interval: float) -> None:
        self.target = target
        self.samples: deque[dict[str, Any]] = deque(maxlen=history_length(interval))
        self.last: Scrape | None = None
        self.last_at = 0.0
        self.failures = 0
        self.window: deque[tuple[float, Scrape]] = deque()
        self.last_text = ""  # the reduced exposition last parsed, and its result:
        self.last_parsed: Scrape | None = None  # an idle replica's is not parsed again

    def add(self, at: float, scrape: Scrape, accelerator: dict[str, Any]) -> dict[str, Any]:
        """Add the sample of a scrape at `at`: gauges, rates and quantiles since the last."""
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


@dataclass(frozen=True)
class ScalingDecision:
    """An autoscaler decision, as the deployment's dashboard charts and lists it."""

    at: float
    current: int
    desired: int
    reason: str
    #: Per signal its figures; the chart keeps CHARTED_SIGNAL_FIGURES of them.
    signals: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def entry(self) -> dict[str, Any]:
        """The decision as a sample and a dashboard message carry it."""
        return {"t": round(self.at, 3), "current": self.current, "desired": self.desired,
                "reason": self.reason,
                "signals": {name: {k: v for k, v in figures.items()
                                   if k in CHARTED_SIGNAL_FIGURES}
                            for name, figures in self.signals.items()}}


@dataclass(frozen=True)
class GatewayReading:
    """The gateway's figures of one pass, per deployment (GatewayCounters.read)."""

    rates: dict[str, dict[str, float | None]]
    in_flight: dict[str, float]
    queued: dict[str, float]
    queue_wait: dict[str, float]
    #: A deployment's figure when the gateway has none for it: 0 with the gateway in this
    #: process (no request for it), else None (unknown).
    idle: float | None

    @classmethod
    def from_counters(cls, read: dict[str, Any], idle: float | None) -> GatewayReading:
        """Split what GatewayCounters.read returned into its parts."""
        read = dict(read)
        return cls(in_flight=read.pop("_in_flight", {}), queued=read.pop("_queued", {}),
                   queue_wait=read.pop("_queue_wait", {}), rates=read, idle=idle)

    def rates_of(self, deployment: str) -> dict[str, float | None]:
        """The deployment's request and error rates (since the last pass, and over the
        summary window); where the gateway has counted no request for it, `idle` for each
        (0 with the gateway in this process: it has answered none)."""
        found = self.rates.get(deployment)
        if found is not None:
            return found
        return dict.fromkeys(("requests_per_s", "error_rate", "window_requests_per_s",
                              "window_error_rate"), self.idle)

    def now(self, deployment: str) -> dict[str, float | None]:
        """In flight, queued and the queue's estimated wait for this deployment."""
        return {"in_flight": self.in_flight.get(deployment, self.idle),
                "queued": self.queued.get(deployment, self.idle),
                "queue_wait_s": self.queue_wait.get(deployment, self.idle)}


class MetricsStore:
    """Every replica's series, the gateway's, and the fleet summary of the last pass."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.replicas: dict[str, ReplicaSeries] = {}
        self.gateway: dict[str, deque[dict[str, Any]]] = {}
        self.fleet: dict[str, Any] = {"type": "fleet", "at": None, "deployments": []}
        self.last_pass_seconds = 0.0

    def series(self, target: Target) -> ReplicaSeries:
        """The replica's series, made at its first scrape; its target kept current."""
        series = self.replicas.get(target.name)
        if series is None:
            series = self.replicas[target.name] = ReplicaSeries(target, self.interval)
        series.target = target
        return series

    def gateway_series(self, deployment: str) -> deque[dict[str, Any]]:
        """The deployment's own series (gateway figures, replica counts, decisions)."""
        series = self.gateway.get(deployment)
        if series is None:
            series = self.gateway[deployment] = deque(maxlen=history_length(self.interval))
        return series

    def forget(self, live: set[str], deployments: set[str]) -> None:
        """Drop the series of replicas and deployments that are gone."""
        for name in set(self.replicas) - live:
            del self.replicas[name]
        for name in set(self.gateway) - deployments:
            del self.gateway[name]

    def add_pass(self, at: float, targets: list[Target], scrapes: list[Scrape | None],
                 accelerators: dict[str, dict[str, Any]]
                 ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
        """Add one pass's scrapes (None: a failed one, counted): per deployment its
        replicas with their new samples, and per deployment its failed scrapes."""
        per_deployment: dict[str, list[dict[str, Any]]] = {}
        failing: dict[str, int] = {}
        for target, scrape in zip(targets, scrapes, strict=True):
            series = self.series(target)
            if scrape is None:
                series.failures += 1
                failing[target.deployment] = failing.get(target.deployment, 0) + 1
                continue
            series.failures = 0
            sample = series.add(at, scrape, accelerators.get(target.name, {}))
            per_deployment.setdefault(target.deployment, []).append(
                {"name": target.name, "role": target.role, "phase": target.phase,
                 "sample": sample})
        return per_deployment, failing

    def summarise(self, at: float, name: str, replicas: list[dict[str, Any]],
                  counts: dict[str, int], gateway: GatewayReading, failures: int
                  ) -> dict[str, Any]:
        """The deployment's update of this pass (its summary, its own sample, its
        replicas' samples); the deployment's own sample joins its series."""
        samples = [r["sample"] for r in replicas if r["role"] != "standby"]
        gate = gateway.rates_of(name)
        now = gateway.now(name)
        # The deployment's own series: the gateway's figures and the replica counts
        # (the autoscaler's decisions, charted on the deployment's dashboard).
        gateway_sample = {"t": round(at, 3), "requests_per_s": gate.get("requests_per_s"),
                          "error_rate": gate.get("error_rate"), **now,
                          "desired": counts["desired"],
                          "ready": counts["ready"], "standby": counts["standby"]}
        self.gateway_series(name).append(gateway_sample)
        window = window_figures([self.replicas[r["name"]] for r in replicas
                                 if r["role"] != "standby"])
        summary = {
            "name": name, "ready": counts["ready"], "desired": counts["desired"],
            "standby": counts["standby"],
            "window_seconds": SUMMARY_SECONDS,
            "requests_per_s": gate.get("window_requests_per_s"),
            **now,
            "tokens_per_s": window["tokens_per_s"],
            "waiting": total(s.get("waiting") for s in samples),
            "running": total(s.get("running") for s in samples),
            "kv_cache": rounded(mean(s.get("kv_cache") for s in samples)),
            "ttft_p50": window["ttft_p50"], "ttft_p95": window["ttft_p95"],
            "error_rate": gate.get("window_error_rate"),
            "scrape_failures": failures,
        }
        return {"type": "update", "deployment": name, "t": round(at, 3),
                "summary": summary, "gateway": gateway_sample, "replicas": replicas}

    def annotate(self, deployment: str, decision: ScalingDecision) -> dict[str, Any] | None:
        """Join an autoscaler decision to the deployment's latest sample (so a dashboard
        that connects later gets it with the history); the message for the dashboards
        open now, or None when the deployment has no sample yet."""
        series = self.gateway.get(deployment)
        if not series:
            return None
        sample = series[-1]
        entry = decision.entry()
        sample["decided"] = decision.desired
        sample["decision"] = entry
        return {"type": "decision", "deployment": deployment, "t": sample["t"],
                "decision": entry}

    def deployment_history(self, deployment: str) -> dict[str, Any]:
        """Everything kept for one deployment: sent when a dashboard connects."""
        return {"type": "history", "deployment": deployment, "interval": self.interval,
                "replicas": {name: {"role": s.target.role, "samples": list(s.samples)}
                             for name, s in sorted(self.replicas.items())
                             if s.target.deployment == deployment},
                "gateway": list(self.gateway.get(deployment, ()))}
