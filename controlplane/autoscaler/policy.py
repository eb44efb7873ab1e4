"""An autoscaling policy (`Deployment.autoscaling`) as a client sends it, checked field by
field (`Policy.from_dict`), and in its stored form (`Policy.as_dict`). Pure: no Django, so
the services that check a deployment's spec import it at the top."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
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
    """A policy that cannot be accepted; `field` names the setting."""

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
        """Whether this window holds at that moment."""
        if DAYS[moment.weekday()] not in self.days:
            return False
        now = moment.strftime("%H:%M")
        if self.start <= self.end:
            return self.start <= now < self.end
        return now >= self.start or now < self.end  # across midnight


@dataclass(frozen=True)
class Policy:
    """The signals and their targets, the bounds and how fast the count may move."""

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
        """The bounds at that moment: a schedule window's, or the deployment's."""
        for window in self.schedule:
            if window.covers(moment):
                return window.min_replicas, window.max_replicas
        return self.min_replicas, self.max_replicas


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise PolicyError(name, "must be a list")
    return value


def check_bounds(where: str, low: Any, high: Any) -> None:
    """Whole numbers, min at most max, max at least 1; raises PolicyError."""
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
    """One schedule entry as a client sends it; raises PolicyError naming it."""
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
