"""The autoscaler: every interval, from the metrics store, the desired number of active
replicas of each deployment that has an autoscaling policy.

A policy (`Deployment.autoscaling`, checked by `Policy.from_dict`) names one or more
signals with targets. Each signal proposes a count the way Kubernetes' HPA does,
ceil(current * value / target), or for per-replica signals ceil(total / target); the
largest proposal wins. The result is kept within min..max (a schedule may give other
bounds by time of day), then stabilized: a scale-up takes the smallest proposal of the
scale-up window, a scale-down the largest of the scale-down window (so one quiet scrape
does not drop capacity), moves at most `max_step` replicas, and waits `cooldown_seconds`
after a change. A signal that is missing or stale never lowers the count: the autoscaler
holds and says why. With min 0 a deployment with no traffic for `idle_seconds` goes to
zero; demand seen at the gateway for it brings one replica back at once.

`decide` is a pure function of the policy, the figures and the remembered proposals, so
whole scenarios are tested without processes; `Autoscaler.run_once` applies decisions
through the same service as a person's change and records each as an event carrying its
inputs.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

SIGNALS = {
    # name: (what it reads, per replica?, what a target means)
    "waiting_per_replica": ("requests waiting in the engines", True, "requests"),
    "kv_cache": ("mean KV-cache use of the active replicas", False, "a fraction, 0-1"),
    "queue_per_replica": ("requests in flight at the gateway", True, "requests"),
    "tokens_per_s_per_replica": ("generated tokens per second", True, "tokens/s"),
    # Offered because operators ask for it; it reads near 100% whenever batching is active,
    # so it is never the default.
    "gpu_utilization": ("mean GPU utilisation of the active replicas", False, "percent"),
}
DEFAULT_SIGNALS = ({"name": "waiting_per_replica", "target": 2.0},)
TIME = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class PolicyError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass(frozen=True)
class Window:
    """Other bounds between two times of day (UTC), on some days."""

    start: str
    end: str
    min_replicas: int
    max_replicas: int
    days: tuple[str, ...] = DAYS

    def covers(self, moment: datetime) -> bool:
        if DAYS[moment.weekday()] not in self.days:
            return False
        now = moment.strftime("%H:%M")
        if self.start <= self.end:
            return self.start <= now < self.end
        return now >= self.start or now < self.end  # across midnight


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    signals: tuple[tuple[str, float], ...] = (("waiting_per_replica", 2.0),)
    schedule: tuple[Window, ...] = ()
    scale_up_window_seconds: float = 0.0
    scale_down_window_seconds: float = 300.0
    max_step: int = 4
    cooldown_seconds: float = 30.0
    idle_seconds: float = 600.0
    enabled: bool = True

    @classmethod
    def from_dict(cls, raw: Any, *, min_replicas: int, max_replicas: int) -> Policy:
        """Check a policy as a client sends it; the deployment's min and max are the
        default bounds."""
        if not isinstance(raw, dict):
            raise PolicyError("autoscaling", "must be an object")
        known = {"enabled", "signals", "schedule", "scale_up_window_seconds",
                 "scale_down_window_seconds", "max_step", "cooldown_seconds", "idle_seconds"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PolicyError(unknown[0], f"unknown setting; known: {', '.join(sorted(known))}")
        check_bounds("autoscaling", min_replicas, max_replicas)
        values: dict[str, Any] = {"min_replicas": min_replicas, "max_replicas": max_replicas}
        if "enabled" in raw:
            if not isinstance(raw["enabled"], bool):
                raise PolicyError("enabled", "must be true or false")
            values["enabled"] = raw["enabled"]
        signals = raw.get("signals", list(DEFAULT_SIGNALS))
        if not isinstance(signals, list) or not signals:
            raise PolicyError("signals", "must be a non-empty list of {name, target}")
        checked = []
        for index, signal in enumerate(signals):
            where = f"signals[{index}]"
            if not isinstance(signal, dict) or set(signal) != {"name", "target"}:
                raise PolicyError(where, "must be {\"name\": ..., \"target\": ...}")
            if signal["name"] not in SIGNALS:
                raise PolicyError(where, f"unknown signal {signal['name']!r}; known: "
                                         f"{', '.join(SIGNALS)}")
            target = signal["target"]
            if isinstance(target, bool) or not isinstance(target, int | float) or not (
                    target > 0 and math.isfinite(target)):
                raise PolicyError(where, "target must be a number above 0")
            if signal["name"] == "kv_cache" and target > 1:
                raise PolicyError(where, "the kv_cache target is a fraction (0-1)")
            checked.append((signal["name"], float(target)))
        if len({name for name, _ in checked}) != len(checked):
            raise PolicyError("signals", "each signal may appear once")
        values["signals"] = tuple(checked)
        for name, low in (("scale_up_window_seconds", 0), ("scale_down_window_seconds", 0),
                          ("cooldown_seconds", 0), ("idle_seconds", 10)):
            if name in raw:
                value = raw[name]
                if isinstance(value, bool) or not isinstance(value, int | float) or not (
                        low <= value <= 86400):
                    raise PolicyError(name, f"must be a number of seconds, {low}-86400")
                values[name] = float(value)
        if "max_step" in raw:
            step = raw["max_step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise PolicyError("max_step", "must be a whole number of at least 1")
            values["max_step"] = step
        values["schedule"] = tuple(check_window(index, window) for index, window in
                                   enumerate(_list(raw.get("schedule", []), "schedule")))
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The stored form (without the bounds, which live on the deployment)."""
        return {"enabled": self.enabled,
                "signals": [{"name": n, "target": t} for n, t in self.signals],
                "schedule": [{"start": w.start, "end": w.end, "days": list(w.days),
                              "min_replicas": w.min_replicas, "max_replicas": w.max_replicas}
                             for w in self.schedule],
                "scale_up_window_seconds": self.scale_up_window_seconds,
                "scale_down_window_seconds": self.scale_down_window_seconds,
                "max_step": self.max_step, "cooldown_seconds": self.cooldown_seconds,
                "idle_seconds": self.idle_seconds}

    def bounds(self, moment: datetime) -> tuple[int, int]:
        for window in self.schedule:
            if window.covers(moment):
                return window.min_replicas, window.max_replicas
        return self.min_replicas, self.max_replicas


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise PolicyError(name, "must be a list")
    return value


def check_bounds(where: str, low: Any, high: Any) -> None:
    for name, value in (("min_replicas", low), ("max_replicas", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PolicyError(f"{where}.{name}" if where != "autoscaling" else name,
                              "must be a whole number of at least 0")
    if low > high:
        raise PolicyError("min_replicas", f"min_replicas ({low}) is above max_replicas "
                                          f"({high})")
    if high < 1:
        raise PolicyError("max_replicas", "must be at least 1 for autoscaling")


def check_window(index: int, raw: Any) -> Window:
    where = f"schedule[{index}]"
    if not isinstance(raw, dict):
        raise PolicyError(where, "must be an object")
    unknown = sorted(set(raw) - {"start", "end", "days", "min_replicas", "max_replicas"})
    if unknown:
        raise PolicyError(where, f"unknown key {unknown[0]!r}")
    for key in ("start", "end"):
        if not isinstance(raw.get(key), str) or not TIME.match(raw[key]):
            raise PolicyError(where, f"{key} must be a time of day HH:MM (UTC)")
    if raw["start"] == raw["end"]:
        raise PolicyError(where, "start and end must differ")
    days = raw.get("days", list(DAYS))
    if not isinstance(days, list) or not days or not all(d in DAYS for d in days):
        raise PolicyError(where, f"days must be a list of {', '.join(DAYS)}")
    check_bounds(where, raw.get("min_replicas"), raw.get("max_replicas"))
    return Window(raw["start"], raw["end"], raw["min_replicas"], raw["max_replicas"],
                  tuple(days))


@dataclass
class Figures:
    """What the metrics store says of one deployment at one moment."""

    at: float  # when the figures were taken (epoch seconds)
    waiting: float | None = None
    running: float | None = None
    kv_cache: float | None = None
    tokens_per_s: float | None = None
    gateway_in_flight: float | None = None
    requests_per_s: float | None = None
    gpu_utilization: float | None = None
    scrape_failures: int = 0
    demand: int = 0  # requests waiting at the gateway for a deployment with no replica


@dataclass
class Memory:
    """What the autoscaler remembers of one deployment between decisions."""

    proposals: deque[tuple[float, int]] = field(default_factory=deque)
    last_change: float = -math.inf
    idle_since: float | None = None
    started: float | None = None
    start_count: int = 0
    last_reason: str = ""


@dataclass
class Decision:
    current: int
    desired: int
    reason: str
    inputs: dict[str, Any]

    @property
    def changes(self) -> bool:
        return self.desired != self.current


def signal_value(name: str, figures: Figures) -> float | None:
    return {
        "waiting_per_replica": figures.waiting,
        "kv_cache": figures.kv_cache,
        "queue_per_replica": figures.gateway_in_flight,
        "tokens_per_s_per_replica": figures.tokens_per_s,
        "gpu_utilization": figures.gpu_utilization,
    }[name]


def propose(name: str, target: float, value: float, current: int) -> int:
    """The count this signal asks for (per-replica signals: the total over the target)."""
    if SIGNALS[name][1]:
        return math.ceil(round(value / target, 6))
    return math.ceil(round(max(current, 1) * value / target, 6))


def decide(policy: Policy, current: int, figures: Figures | None, memory: Memory,
           now: float, moment: datetime, *, stale_seconds: float) -> Decision:
    """The desired active count for this moment, and why."""
    low, high = policy.bounds(moment)
    inputs: dict[str, Any] = {"current": current, "min": low, "max": high, "signals": {}}

    def done(desired: int, reason: str) -> Decision:
        inputs["result"] = desired
        return Decision(current, desired, reason, inputs)

    if current < low:
        memory.last_change = now
        return done(low, f"below the minimum ({low})")
    if current > high:
        memory.last_change = now
        return done(high, f"above the maximum ({high})")
    if current == 0:  # demand is counted by the gateway, not scraped: never stale
        waiting = figures.demand if figures is not None else 0
        inputs["demand"] = waiting
        if waiting > 0:
            memory.idle_since = None
            memory.last_change = now
            return done(1, f"waking: {waiting} request(s) waiting at the gateway")
        return done(0, "scaled to zero: no demand")
    if figures is None or now - figures.at > stale_seconds:
        return done(current, "holding: no recent metrics (the collector has not scraped "
                             "this deployment lately)")
    proposals: list[int] = []
    missing: list[str] = []
    for name, target in policy.signals:
        value = signal_value(name, figures)
        if value is None:
            missing.append(name)
            inputs["signals"][name] = {"value": None, "target": target}
            continue
        wanted = propose(name, target, value, current)
        inputs["signals"][name] = {"value": round(value, 4), "target": target,
                                   "proposes": wanted}
        proposals.append(wanted)
    failing = figures.scrape_failures > 0
    raw = max(proposals) if proposals else current
    # Idle to zero (min 0): no traffic at all for idle_seconds.
    busy = any((v or 0) > 0 for v in (figures.running, figures.waiting,
                                       figures.gateway_in_flight, figures.requests_per_s))
    if busy or failing:
        memory.idle_since = None
    elif memory.idle_since is None:
        memory.idle_since = now
    if low == 0 and memory.idle_since is not None and now - memory.idle_since >= \
            policy.idle_seconds:
        inputs["idle_seconds"] = round(now - memory.idle_since, 1)
        memory.proposals.clear()
        memory.last_change = now
        return done(0, f"idle for {now - memory.idle_since:.0f} s: scaling to zero")
    bounded = min(max(raw, max(low, 1)), high)
    if memory.started is None:
        memory.started, memory.start_count = now, current
    memory.proposals.append((now, bounded))
    horizon = max(policy.scale_up_window_seconds, policy.scale_down_window_seconds)
    while memory.proposals and memory.proposals[0][0] < now - horizon:
        memory.proposals.popleft()
    up = min(p for t, p in memory.proposals if t >= now - policy.scale_up_window_seconds)
    down = max(p for t, p in memory.proposals if t >= now - policy.scale_down_window_seconds)
    if now - memory.started < policy.scale_down_window_seconds:
        # Nothing remembered from before (a controller start): no scale-down below the
        # count found until a whole window has been seen.
        down = max(down, memory.start_count)
    inputs["proposed"] = bounded
    if up > current:
        desired = min(up, current + policy.max_step)
        reason = "scaling up: " + strongest(inputs)
    elif down < current:
        if missing or failing:
            why = (f"signal(s) {', '.join(missing)} missing" if missing else
                   f"{figures.scrape_failures} replica scrape(s) failing")
            return done(current, f"holding: {why}, so no scale-down")
        desired = max(down, current - policy.max_step)
        reason = "scaling down: " + strongest(inputs)
    else:
        return done(current, "steady")
    if now - memory.last_change < policy.cooldown_seconds:
        return done(current, f"cooling down ({policy.cooldown_seconds:.0f} s after the last "
                             f"change)")
    memory.last_change = now
    return done(desired, reason)


def strongest(inputs: dict[str, Any]) -> str:
    signals = [(s.get("proposes") or 0, name, s) for name, s in inputs["signals"].items()
               if s.get("value") is not None]
    if not signals:
        return "bounds"
    _, name, signal = max(signals)
    return f"{name} {signal['value']} against a target of {signal['target']:g}"


def figures_from_summary(summary: dict[str, Any], at: float, demand: int,
                         gpu: float | None) -> Figures:
    """The collector's per-deployment summary (controlplane/collector.py) as figures."""
    return Figures(
        at=at, waiting=summary.get("waiting"),
        running=summary.get("running"), kv_cache=summary.get("kv_cache"),
        tokens_per_s=summary.get("tokens_per_s"),
        gateway_in_flight=summary.get("in_flight"),
        requests_per_s=summary.get("requests_per_s"), gpu_utilization=gpu,
        scrape_failures=int(summary.get("scrape_failures") or 0), demand=demand)


def decision_record(decision: Decision) -> dict[str, Any]:
    return {"current": decision.current, "desired": decision.desired,
            "reason": decision.reason, **decision.inputs}


class Autoscaler:
    """Decides for every running deployment with an enabled policy, from the collector in
    this process; applies changes to `Deployment.replicas` (the reconciler does the rest)
    and records each change, and each new reason for holding, as an event with its
    inputs."""

    ACTOR = "autoscaler"

    def __init__(self) -> None:
        self.memory: dict[int, Memory] = {}
        # Dashboard messages for the decisions of the last passes, sent by the caller
        # (`controllers.run_autoscaler`) from its event loop, then cleared.
        self.charted: list[dict[str, Any]] = []

    def run_once(self, now: float | None = None, moment: datetime | None = None
                 ) -> list[tuple[str, Decision]]:
        """Decide for every deployment; each decision is also added to the collector's
        series of its deployment (charted and listed on the dashboard), see
        `chart_decision`."""
        import time
        from datetime import UTC

        from django.conf import settings

        from controlplane.collector import current
        from controlplane.models import Deployment
        from controlplane.services import audit
        from serving.demand import total as demand_total

        now = time.time() if now is None else now
        moment = datetime.now(UTC) if moment is None else moment
        collector = current()
        fleet = collector.store.fleet if collector is not None else {}
        summaries = {d["name"]: d for d in fleet.get("deployments") or []}
        at = float(fleet.get("t") or 0.0)
        decisions = []
        deployments = Deployment.objects.filter(
            deleting=False, state=Deployment.State.RUNNING).exclude(autoscaling=None)
        for deployment in deployments:
            try:
                policy = Policy.from_dict(deployment.autoscaling,
                                          min_replicas=deployment.min_replicas,
                                          max_replicas=deployment.max_replicas)
            except PolicyError:
                continue  # stored policies are checked on the way in; an old one is skipped
            if not policy.enabled:
                continue
            memory = self.memory.setdefault(deployment.pk, Memory())
            summary = summaries.get(deployment.name)
            waiting = (demand_total(deployment.name, settings.REDIS_URL)
                       if deployment.replicas == 0 else 0)
            figures = (figures_from_summary(summary, at, demand=waiting, gpu=gpu_of(
                collector, deployment.name)) if summary is not None else
                Figures(at=now, demand=waiting) if waiting else None)
            decision = decide(policy, deployment.replicas, figures, memory, now, moment,
                              stale_seconds=3 * settings.SCRAPE_INTERVAL)
            decisions.append((deployment.name, decision))
            self.charted.extend(chart_decision(collector, deployment.name, decision, now))
            record = decision_record(decision)
            if decision.changes:
                changed = Deployment.objects.filter(
                    pk=deployment.pk, replicas=deployment.replicas).update(
                    replicas=decision.desired)
                if changed:
                    audit(self.ACTOR, "autoscaled", deployment,
                          f"{deployment.replicas} -> {decision.desired} replicas: "
                          f"{decision.reason}", before={"replicas": deployment.replicas},
                          after=record)
                if changed and decision.desired > decision.current:
                    from controlplane.reconciler import promote_now

                    promote_now(deployment.pk)  # a ready standby serves at once
                memory.last_reason = ""
            elif decision.reason.startswith("holding") and decision.reason != \
                    memory.last_reason:
                audit(self.ACTOR, "autoscaler-holding", deployment, decision.reason,
                      after=record)
                memory.last_reason = decision.reason
            elif not decision.reason.startswith("holding"):
                memory.last_reason = ""
        live = {d.pk for d in deployments}
        for pk in set(self.memory) - live:
            del self.memory[pk]
        return decisions


def chart_decision(collector: Any, deployment: str, decision: Decision, now: float
                   ) -> list[dict[str, Any]]:
    """Every decision, steady ones included, joins the deployment's latest sample in the
    metrics store (so a dashboard that connects later gets it with the history) and
    becomes one message for the dashboards open now. The event log keeps only changes and
    new reasons for holding."""
    series = collector.store.gateway.get(deployment) if collector is not None else None
    if not series:
        return []
    sample = series[-1]
    entry = {"t": round(now, 3), "current": decision.current, "desired": decision.desired,
             "reason": decision.reason,
             "signals": {name: {k: v for k, v in figures.items() if k in
                                ("value", "target", "proposes")}
                         for name, figures in decision.inputs.get("signals", {}).items()}}
    sample["decided"] = decision.desired
    sample["decision"] = entry
    return [{"type": "decision", "deployment": deployment, "t": sample["t"],
             "decision": entry}]


def gpu_of(collector: Any, deployment: str) -> float | None:
    """Mean GPU utilisation of the deployment's active replicas in the last pass."""
    if collector is None:
        return None
    values = []
    for series in collector.store.replicas.values():
        if series.target.deployment == deployment and series.target.role != "standby" \
                and series.samples:
            value = series.samples[-1].get("gpu_util")
            if value is not None:
                values.append(float(value))
    return sum(values) / len(values) if values else None
