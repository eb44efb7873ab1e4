"""Priority classes: named levels for admission, set by PRIORITY_CLASSES.

A lower level goes first (vLLM's convention for `priority`). Each class bounds its queue:
at most `max_queued` requests waiting per deployment, each for at most `max_wait_seconds`.
`share` is the part of a deployment's slots that requests of the class may hold together
with everything else running: batch traffic alone never fills the last quarter, so an
urgent request finds a free slot at once instead of waiting for one to finish.
A key carries the highest class it may use; a request may ask for a lower one with the
`X-Priority` header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DEFAULT_CLASSES: dict[str, dict[str, float]] = {
    "critical": {"level": 0, "max_queued": 200, "max_wait_seconds": 30, "share": 1.0},
    "standard": {"level": 10, "max_queued": 1000, "max_wait_seconds": 60, "share": 0.9},
    "batch": {"level": 20, "max_queued": 10000, "max_wait_seconds": 300, "share": 0.75},
}
FIELDS = ("level", "max_queued", "max_wait_seconds", "share")
DEFAULT_CLASS = "standard"


@dataclass(frozen=True)
class PriorityClass:
    name: str
    level: int
    max_queued: int
    max_wait_seconds: float
    share: float = 1.0

    def slots(self, capacity: int) -> int:
        """How many of `capacity` slots may be busy for a request of this class to start
        (at least one, so a class always makes progress)."""
        return max(1, int(capacity * self.share + 1e-9)) if capacity else 0


def parse_classes(text: str | None, variable: str = "PRIORITY_CLASSES"
                  ) -> dict[str, PriorityClass]:
    """The classes from JSON (`{"name": {"level": .., "max_queued": .., "max_wait_seconds":
    .., "share": ..}}`), or the defaults; a bad value raises ValueError naming what is
    wrong."""
    raw: Any = DEFAULT_CLASSES if not text else None
    if raw is None:
        try:
            raw = json.loads(text or "")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{variable} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{variable} must be a JSON object of classes")
    classes = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 30:
            raise ValueError(f"{variable}: class name {name!r} must be a short identifier")
        if not isinstance(spec, dict) or set(spec) - set(FIELDS):
            raise ValueError(f"{variable}.{name} takes {', '.join(FIELDS)}")
        level, queued = spec.get("level"), spec.get("max_queued", 1000)
        wait = spec.get("max_wait_seconds", 60)
        if isinstance(level, bool) or not isinstance(level, int):
            raise ValueError(f"{variable}.{name}.level must be a whole number")
        if isinstance(queued, bool) or not isinstance(queued, int) or queued < 0:
            raise ValueError(f"{variable}.{name}.max_queued must be a whole number >= 0")
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise ValueError(f"{variable}.{name}.max_wait_seconds must be a number >= 0")
        share = spec.get("share", 1.0)
        if isinstance(share, bool) or not isinstance(share, int | float) or \
                not 0 < share <= 1:
            raise ValueError(f"{variable}.{name}.share must be a fraction above 0, at most 1")
        classes[name] = PriorityClass(name, level, queued, float(wait), float(share))
    if DEFAULT_CLASS not in classes:
        raise ValueError(f"{variable} must define the class {DEFAULT_CLASS!r} (the default)")
    return classes


def classes() -> dict[str, PriorityClass]:
    from serving.hot_settings import hot

    return hot.PRIORITY_CLASSES  # type: ignore[no-any-return]
