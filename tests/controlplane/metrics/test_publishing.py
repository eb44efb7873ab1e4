"""The fleet socket's messages (controlplane/metrics/publishing.py): the busiest
deployments whole, then what changed, small however large the fleet."""

from __future__ import annotations

from typing import Any

import orjson

from controlplane.metrics.publishing import FLEET_ROWS, SNAPSHOT_EVERY, FleetView


def summary(name: str, requests: float = 0.0, **figures: Any) -> dict[str, Any]:
    return {"name": name, "ready": 1, "desired": 1, "standby": 0, "window_seconds": 30.0,
            "requests_per_s": requests, "in_flight": 0, "queued": 0, "queue_wait_s": 0,
            "tokens_per_s": 0.0, "waiting": 0, "running": 0, "kv_cache": 0.01,
            "ttft_p50": None, "ttft_p95": None, "error_rate": 0.0, "scrape_failures": 0,
            **figures}


def fleet(summaries: list[dict[str, Any]], t: float = 1.0) -> dict[str, Any]:
    return {"type": "fleet", "t": t, "deployments": summaries}


def size(message: dict[str, Any]) -> int:
    return len(orjson.dumps(message))


THOUSAND = [summary(f"d-{i:04d}", requests=float(i % 7)) for i in range(1000)]


def test_the_first_message_is_the_busiest_deployments_with_totals_of_all() -> None:
    view = FleetView()
    first = view.next_message(fleet(THOUSAND))
    assert first["type"] == "fleet" and first["seq"] == 1
    assert len(first["deployments"]) == FLEET_ROWS and first["total"] == 1000
    assert {d["requests_per_s"] for d in first["deployments"]} == {6.0}
    assert first["totals"]["deployments"] == 1000 and first["totals"]["ready"] == 1000
    assert first["totals"]["requests_per_s"] == sum(i % 7 for i in range(1000))
    assert size(first) < 30_000


def test_a_pass_that_changed_nothing_sends_no_rows() -> None:
    view = FleetView()
    view.next_message(fleet(THOUSAND))
    second = view.next_message(fleet(THOUSAND, t=3.0))
    assert second["type"] == "fleet.delta" and second["seq"] == 2
    assert second["changed"] == [] and second["removed"] == []
    assert size(second) < 1000


def test_a_delta_holds_the_rows_that_changed_and_those_that_left_the_view() -> None:
    view = FleetView(rows=3)
    view.next_message(fleet([summary("a", 3), summary("b", 2), summary("c", 1),
                             summary("d", 0)]))
    delta = view.next_message(fleet([summary("a", 3, waiting=4), summary("b", 2),
                                     summary("d", 5)]))
    assert [d["name"] for d in delta["changed"]] == ["d", "a"]  # d rose into the view
    assert delta["removed"] == ["c"]  # c is gone (and would have left the view anyway)
    assert delta["total"] == 3 and delta["totals"]["requests_per_s"] == 10


def test_the_whole_view_is_sent_again_every_so_many_passes() -> None:
    view = FleetView()
    kinds = [view.next_message(fleet(THOUSAND))["type"] for _ in range(SNAPSHOT_EVERY + 1)]
    assert kinds[0] == kinds[-1] == "fleet"
    assert set(kinds[1:-1]) == {"fleet.delta"}
    assert orjson.loads(view.snapshot_text or "{}")["seq"] == SNAPSHOT_EVERY + 1
