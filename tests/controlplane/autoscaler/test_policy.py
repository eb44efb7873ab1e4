"""Autoscaling policies: refused with the field at fault, or stored and read back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from controlplane.autoscaler import Policy, PolicyError


def policy(**raw: Any) -> Policy:
    low, high = raw.pop("min", 1), raw.pop("max", 4)
    return Policy.from_dict(raw, min_replicas=low, max_replicas=high)


@pytest.mark.parametrize(("raw", "bounds", "field"), [
    ({}, (3, 2), "min_replicas"),
    ({}, (-1, 2), "min_replicas"),
    ({}, (0, 0), "max_replicas"),
    ({"signals": [{"name": "vibes", "target": 1}]}, (1, 2), "signals[0]"),
    ({"signals": [{"name": "kv_cache", "target": 0}]}, (1, 2), "signals[0]"),
    ({"signals": [{"name": "kv_cache", "target": 80}]}, (1, 2), "signals[0]"),
    ({"signals": []}, (1, 2), "signals"),
    ({"signals": [{"name": "kv_cache", "target": 0.8}] * 2}, (1, 2), "signals"),
    ({"max_step": 0}, (1, 2), "max_step"),
    ({"cooldown_seconds": -5}, (1, 2), "cooldown_seconds"),
    ({"schedule": [{"start": "25:00", "end": "10:00", "min_replicas": 1,
                    "max_replicas": 2}]}, (1, 2), "schedule[0]"),
    ({"schedule": [{"start": "09:00", "end": "10:00", "min_replicas": 3,
                    "max_replicas": 2}]}, (1, 2), "min_replicas"),
    ({"colour": "red"}, (1, 2), "colour"),
])
def test_bad_policies_are_refused_with_the_field(raw: dict[str, Any],
                                                 bounds: tuple[int, int], field: str) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_dict(raw, min_replicas=bounds[0], max_replicas=bounds[1])
    assert caught.value.field == field


def test_a_policy_round_trips() -> None:
    chosen = policy(signals=[{"name": "gpu_utilization", "target": 85}],
                    schedule=[{"start": "22:00", "end": "06:00", "min_replicas": 0,
                               "max_replicas": 1}])
    again = Policy.from_dict(chosen.as_dict(), min_replicas=1, max_replicas=4)
    assert again == chosen
    assert again.bounds(datetime(2026, 11, 30, 23, 30, tzinfo=UTC)) == (0, 1)  # overnight
