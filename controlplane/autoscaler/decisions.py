"""`decide`: the desired active count of one deployment at one moment, a pure function of
the policy, the figures and what is remembered of earlier proposals.

Each signal proposes a count the way Kubernetes' HPA does, ceil(current * value / target),
or for per-replica signals ceil(total / target); the largest proposal wins. The result is
kept within the bounds, then stabilized: a scale-up takes the smallest proposal of the
scale-up window, a scale-down the largest of the scale-down window, moves at most
`max_step` replicas, and waits `cooldown_seconds` after a change.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.autoscaler.policy import SIGNALS, Policy

if TYPE_CHECKING:
    from datetime import datetime


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
    """The count found, the count wanted, why, and the inputs it came from."""

    current: int
    desired: int
    reason: str
    inputs: dict[str, Any]

    @property
    def changes(self) -> bool:
        """Whether the decision changes the count."""
        return self.desired != self.current


@dataclass
class Draft:
    """A decision in the making: the count, its bounds, the time, the inputs so far."""

    current: int
    low: int
    high: int
    now: float
    inputs: dict[str, Any]

    def done(self, desired: int, reason: str) -> Decision:
        """The decision, with its result among its inputs."""
        self.inputs["result"] = desired
        return Decision(self.current, desired, reason, self.inputs)


def signal_value(name: str, figures: Figures) -> float | None:
    """The figure a signal reads (None: not measured)."""
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
    draft = Draft(current, low, high, now,
                  {"current": current, "min": low, "max": high, "signals": {}})
    if current < low:
        memory.last_change = now
        return draft.done(low, f"below the minimum ({low})")
    if current > high:
        memory.last_change = now
        return draft.done(high, f"above the maximum ({high})")
    if current == 0:  # demand is counted by the gateway, not scraped: never stale
        return wake(draft, figures, memory)
    if figures is None or now - figures.at > stale_seconds:
        return draft.done(current, "holding: no recent metrics (the collector has not "
                                   "scraped this deployment lately)")
    raw, missing = proposals(policy, figures, draft)
    idle = to_zero(policy, figures, memory, draft)
    if idle is not None:
        return idle
    bounded = min(max(raw, max(low, 1)), high)
    window = stabilize(policy, bounded, memory, draft)
    draft.inputs["proposed"] = bounded
    hold = (f"signal(s) {', '.join(missing)} missing" if missing else
            f"{figures.scrape_failures} replica scrape(s) failing"
            if figures.scrape_failures > 0 else "")
    return move(policy, draft, window, hold, memory)


def wake(draft: Draft, figures: Figures | None, memory: Memory) -> Decision:
    """At zero: one replica as soon as a request waits for one at the gateway."""
    waiting = figures.demand if figures is not None else 0
    draft.inputs["demand"] = waiting
    if waiting > 0:
        memory.idle_since = None
        memory.last_change = draft.now
        return draft.done(1, f"waking: {waiting} request(s) waiting at the gateway")
    return draft.done(0, "scaled to zero: no demand")


def proposals(policy: Policy, figures: Figures, draft: Draft) -> tuple[int, list[str]]:
    """The largest count the signals propose (the current one if none can), and the
    signals that could not be read; each signal's figures join the inputs."""
    proposed: list[int] = []
    missing: list[str] = []
    for name, target in policy.signals:
        value = signal_value(name, figures)
        if value is None:
            missing.append(name)
            draft.inputs["signals"][name] = {"value": None, "target": target}
            continue
        wanted = propose(name, target, value, draft.current)
        draft.inputs["signals"][name] = {"value": round(value, 4), "target": target,
                                         "proposes": wanted}
        proposed.append(wanted)
    return (max(proposed) if proposed else draft.current), missing


def to_zero(policy: Policy, figures: Figures, memory: Memory, draft: Draft
            ) -> Decision | None:
    """Idle to zero (min 0): no traffic at all for idle_seconds; None while not idle."""
    now = draft.now
    busy = any((v or 0) > 0 for v in (figures.running, figures.waiting,
                                       figures.gateway_in_flight, figures.requests_per_s))
    if busy or figures.scrape_failures > 0:
        memory.idle_since = None
    elif memory.idle_since is None:
        memory.idle_since = now
    if draft.low == 0 and memory.idle_since is not None and now - memory.idle_since >= \
            policy.idle_seconds:
        draft.inputs["idle_seconds"] = round(now - memory.idle_since, 1)
        memory.proposals.clear()
        memory.last_change = now
        return draft.done(0, f"idle for {now - memory.idle_since:.0f} s: scaling to zero")
    return None


def stabilize(policy: Policy, bounded: int, memory: Memory, draft: Draft
              ) -> tuple[int, int]:
    """Remember this proposal; the smallest of the scale-up window and the largest of
    the scale-down window (after a controller start, no scale-down below the count found
    until a whole window has been seen)."""
    now = draft.now
    if memory.started is None:
        memory.started, memory.start_count = now, draft.current
    memory.proposals.append((now, bounded))
    horizon = max(policy.scale_up_window_seconds, policy.scale_down_window_seconds)
    while memory.proposals and memory.proposals[0][0] < now - horizon:
        memory.proposals.popleft()
    up = min(p for t, p in memory.proposals if t >= now - policy.scale_up_window_seconds)
    down = max(p for t, p in memory.proposals if t >= now - policy.scale_down_window_seconds)
    if now - memory.started < policy.scale_down_window_seconds:
        down = max(down, memory.start_count)
    return up, down


def move(policy: Policy, draft: Draft, window: tuple[int, int], hold: str,
         memory: Memory) -> Decision:
    """Up by at most max_step, or down by at most max_step unless `hold` says why not,
    or steady; no change within the cooldown after the last one."""
    up, down = window
    current = draft.current
    if up > current:
        desired = min(up, current + policy.max_step)
        reason = "scaling up: " + strongest(draft.inputs)
    elif down < current:
        if hold:
            return draft.done(current, f"holding: {hold}, so no scale-down")
        desired = max(down, current - policy.max_step)
        reason = "scaling down: " + strongest(draft.inputs)
    else:
        return draft.done(current, "steady")
    if draft.now - memory.last_change < policy.cooldown_seconds:
        return draft.done(current, f"cooling down ({policy.cooldown_seconds:.0f} s after the "
                                   f"last change)")
    memory.last_change = draft.now
    return draft.done(desired, reason)


def strongest(inputs: dict[str, Any]) -> str:
    """The signal that proposed the most, with its value and target."""
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
