"""The autoscaler's decisions through whole scenarios: spike, slow ramp, flapping load,
scrape outage, idle to zero and back, step and cooldown limits, schedules. Load is
described as the engines' waiting queue over time (what the collector reads from fake or
real engines); replicas follow each decision at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from controlplane.autoscaler import Figures, Memory, Policy, decide

INTERVAL = 2.0
NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)  # a Monday


def policy(**raw: Any) -> Policy:
    low, high = raw.pop("min", 1), raw.pop("max", 4)
    return Policy.from_dict(raw, min_replicas=low, max_replicas=high)


def run(chosen: Policy, start: int, seconds: float,
        load: Callable[[float, int], dict[str, Any] | None], moment: datetime = NOON
        ) -> list[tuple[float, int, str]]:
    """Decide every INTERVAL for `seconds`; `load(t, active)` gives the figures' fields.
    Returns (time, count after the decision, reason) per decision."""
    memory, current, history = Memory(), start, []
    t = 0.0
    while t <= seconds:
        fields = load(t, current)
        figures = None if fields is None else Figures(at=fields.pop("at", t), **fields)
        decision = decide(chosen, current, figures, memory, t, moment,
                          stale_seconds=3 * INTERVAL)
        current = decision.desired
        history.append((t, current, decision.reason))
        t += INTERVAL
    return history


def counts(history: list[tuple[float, int, str]]) -> list[int]:
    return [count for _, count, _ in history]


def quiet(t: float, active: int) -> dict[str, Any]:
    return {"waiting": 0.0, "running": 0.0, "gateway_in_flight": 0.0, "requests_per_s": 0.0}


def test_a_spike_scales_up_at_the_next_decision() -> None:
    chosen = policy(signals=[{"name": "waiting_per_replica", "target": 2}],
                    scale_down_window_seconds=60, cooldown_seconds=0)
    history = run(chosen, 1, 20, lambda t, n: {"waiting": 20.0 if t >= 10 else 0.0,
                                               "running": 4.0 * n})
    before = [c for t, c, _ in history if t < 10]
    assert set(before) == {1}
    [(_t, count, reason)] = [h for h in history if h[0] == 10]
    assert count == 4  # ceil(20 / 2) = 10, bounded by max 4, within one interval
    assert "waiting_per_replica 20.0 against a target of 2" in reason


def test_a_slow_ramp_climbs_step_by_step_and_never_back() -> None:
    chosen = policy(max=8, signals=[{"name": "waiting_per_replica", "target": 2}],
                    cooldown_seconds=0)
    history = run(chosen, 1, 120, lambda t, n: {"waiting": t / 10, "running": 4.0 * n})
    seen = counts(history)
    assert seen == sorted(seen)  # only up
    assert seen[-1] == 6  # 12 waiting / 2
    assert len(set(seen)) >= 5  # several steps, not one jump


def test_flapping_load_does_not_flap_the_count() -> None:
    chosen = policy(signals=[{"name": "waiting_per_replica", "target": 2}],
                    scale_down_window_seconds=60, cooldown_seconds=0)
    history = run(chosen, 1, 200, lambda t, n: {
        "waiting": 8.0 if int(t / INTERVAL) % 2 else 0.0, "running": 4.0 * n})
    seen = counts(history)
    changes = sum(1 for a, b in itertools.pairwise(seen) if a != b)
    assert changes == 1 and seen[-1] == 4  # up once, then held through the dips


def test_load_gone_scales_down_after_the_window_by_steps() -> None:
    chosen = policy(signals=[{"name": "waiting_per_replica", "target": 2}],
                    scale_down_window_seconds=30, max_step=1, cooldown_seconds=0)
    history = run(chosen, 4, 80, lambda t, n: {"waiting": 0.0, "running": 1.0 * n})
    first_down = next(t for t, c, _ in history if c < 4)
    assert first_down >= 30  # not before the scale-down window has only low proposals
    seen = counts(history)
    assert all(a - b <= 1 for a, b in itertools.pairwise(seen))  # one at a time
    assert seen[-1] == 1  # down to the minimum, not below


def test_a_scrape_outage_never_scales_down() -> None:
    chosen = policy(signals=[{"name": "waiting_per_replica", "target": 2}],
                    scale_down_window_seconds=0, cooldown_seconds=0)

    def outage(t: float, n: int) -> dict[str, Any] | None:
        if t < 20:
            return {"waiting": 6.0, "running": 4.0 * n}
        if t < 40:  # scrapes fail: no waiting figure, failures counted
            return {"waiting": None, "running": None, "scrape_failures": n}
        return {"at": 39.0}  # then the collector itself stops: stale figures

    history = run(chosen, 1, 60, outage)
    assert [c for t, c, _ in history if t >= 4] == [3] * len([h for h in history if h[0] >= 4])
    reasons = {reason for t, _, reason in history if t >= 20}
    assert any(r.startswith("holding: signal(s) waiting_per_replica missing") or
               r.startswith("holding") for r in reasons)
    assert any("no recent metrics" in r for r in reasons)


def test_idle_goes_to_zero_and_demand_brings_one_back() -> None:
    chosen = policy(min=0, idle_seconds=60, cooldown_seconds=0,
                    signals=[{"name": "waiting_per_replica", "target": 2}])

    def day(t: float, n: int) -> dict[str, Any]:
        if t < 20:
            return {"waiting": 0.0, "running": 2.0, "requests_per_s": 1.0}
        if t < 120:
            return quiet(t, n) | {"demand": 0}
        return quiet(t, n) | {"demand": 3}

    history = run(chosen, 1, 124, day)
    zero_at = next(t for t, c, _ in history if c == 0)
    assert 80 <= zero_at <= 84  # quiet from t=20, idle for 60 s
    assert "idle for 6" in next(r for t, c, r in history if t == zero_at)
    [(_, count, reason)] = [h for h in history if h[0] == 120]
    assert count == 1 and "waking: 3 request(s)" in reason


def test_cooldown_spaces_changes() -> None:
    chosen = policy(max=10, signals=[{"name": "waiting_per_replica", "target": 1}],
                    max_step=1, cooldown_seconds=10)
    history = run(chosen, 1, 40, lambda t, n: {"waiting": 50.0, "running": 4.0 * n})
    changes = [t for (t, c, _), (_, before, _) in zip(history[1:], history, strict=False)
               if c != before]
    assert all(b - a >= 10 for a, b in itertools.pairwise(changes))
    assert counts(history)[-1] == 6  # one step at 0, 10, 20, 30 and 40 s, from 1


def test_the_largest_proposal_of_several_signals_wins() -> None:
    chosen = policy(max=10, cooldown_seconds=0, signals=[
        {"name": "waiting_per_replica", "target": 4},
        {"name": "kv_cache", "target": 0.5}])
    history = run(chosen, 2, 0, lambda t, n: {"waiting": 4.0, "kv_cache": 0.9})
    [(_, count, reason)] = history
    assert count == 4  # kv: ceil(2 * 0.9 / 0.5) = 4 beats waiting: ceil(4 / 4) = 1
    assert reason.startswith("scaling up: kv_cache 0.9")


def test_a_schedule_gives_other_bounds_by_time_of_day() -> None:
    chosen = policy(min=1, max=4, schedule=[
        {"start": "09:00", "end": "17:00", "days": ["mon", "tue", "wed", "thu", "fri"],
         "min_replicas": 3, "max_replicas": 6}])
    [(_, count, reason)] = run(chosen, 1, 0, quiet)
    assert count == 3 and "below the minimum (3)" in reason
    night = datetime(2026, 11, 30, 22, 0, tzinfo=UTC)
    [(_, count, _)] = run(chosen, 1, 0, quiet, moment=night)
    assert count == 1

