"""Rollouts, scale-downs and deletes under load lose no request: `manage.py serve` with a
deployment of 2 local replicas (FAKE engines: fakes/vllm_cli.py) and 16 clients streaming
through its gateway without pause, while the deployment is restarted, scaled down and
deleted, directly and through a gateway process that follows the route table through
Redis (docs/deployments.md, "A replica's life")."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.controlplane.reliability.traffic import Fleet, Traffic, running_fleet
from tests.processes import Api, wait_until
from tests.services import private_redis

pytestmark = pytest.mark.slow

# 50 tokens 25 ms apart: each stream lasts about 1.3 s.
TOKEN_INTERVAL_MS = 25
DRAIN_TIMEOUT = 1
STOP_GRACE = 2


def restart_then_scale_down(fleet: Fleet, traffic: Traffic) -> None:
    """Under the traffic: a rolling restart of the 2 replicas, then a scale-down to 1,
    each once 16 more streams were answered (labelled, so failures say when)."""
    traffic.wait_for_answers(16)
    traffic.label = "restart"
    restarted = fleet.api.post("/api/v1/deployments/chat/restart/")
    assert restarted.status_code == 200, restarted.text
    generation = restarted.json()["generation"]
    wait_until("both replicas of the new generation and ready, the old ones gone",
               lambda: [(r["generation"], r["phase"]) for r in fleet.replicas("chat")
                        ] == [(generation, "ready")] * 2, 90)
    traffic.wait_for_answers(16, "restart")
    traffic.label = "scale-down"
    scaled = fleet.api.post("/api/v1/deployments/chat/scale/", {"replicas": 1})
    assert scaled.status_code == 200, scaled.text
    wait_until("one replica left", lambda: len(fleet.replicas("chat")) == 1, 60)
    traffic.wait_for_answers(16, "scale-down")


def test_a_rolling_restart_and_a_scale_down_under_load_fail_no_request(
        tmp_path: Path) -> None:
    with running_fleet(tmp_path, TOKEN_INTERVAL_MS) as fleet:
        fleet.deploy("chat", 2)
        traffic = fleet.traffic("chat").start()
        try:
            restart_then_scale_down(fleet, traffic)
        finally:
            outcomes = traffic.stop()
    failed = [o for o in outcomes if not o.ok]
    assert failed == []
    assert {o.label for o in outcomes} == {"steady", "restart", "scale-down"}


def test_deleting_a_deployment_under_load_finishes_its_streams_then_answers_404(
        tmp_path: Path) -> None:
    with running_fleet(tmp_path, TOKEN_INTERVAL_MS) as fleet:
        fleet.deploy("chat", 2)
        traffic = fleet.traffic("chat").start()
        try:
            traffic.wait_for_answers(16)
            traffic.label = "delete"
            deleted_at = time.monotonic()
            assert fleet.delete("chat") == 202
            wait_until("the deployment gone", lambda: not any(
                d["name"] == "chat" for d in fleet.api.get("/api/v1/deployments/")[
                    "results"]), 60)
            traffic.label = "after"
            wait_until("refusals after the delete", lambda: sum(
                1 for o in traffic.outcomes if o.label == "after") >= 16, 30)
        finally:
            outcomes = traffic.stop()
    during = [o for o in outcomes if o.label in ("steady", "delete")]
    after = [o for o in outcomes if o.label == "after"]
    assert [o for o in during if not (o.ok or o.not_found)] == []
    assert [o for o in after if not o.not_found] == []
    # Streams were running when the deployment was deleted, and each of them finished.
    assert [o for o in during if o.started < deleted_at < o.ended and not o.ok] == []
    assert any(o.started < deleted_at < o.ended for o in during)


def test_a_drain_past_its_deadline_ends_the_streams_left_with_an_sse_error(
        tmp_path: Path) -> None:
    # Streams of 400 tokens (10 s) against a drain deadline of 1 s.
    with running_fleet(tmp_path, TOKEN_INTERVAL_MS, DRAIN_TIMEOUT_SECONDS=str(DRAIN_TIMEOUT),
                       STOP_GRACE_SECONDS=str(STOP_GRACE)) as fleet:
        fleet.deploy("chat", 2)
        traffic = fleet.traffic("chat", clients=8, max_tokens=400).start()
        try:
            wait_until("streams on both replicas", lambda: all(
                fleet.engine_running(r) > 0 for r in fleet.replicas("chat")), 30)
            traffic.label = "scale-down"
            scaled = fleet.api.post("/api/v1/deployments/chat/scale/", {"replicas": 1})
            assert scaled.status_code == 200, scaled.text
            wait_until("one replica left", lambda: len(fleet.replicas("chat")) == 1, 60)
        finally:
            outcomes = traffic.stop()
    cut = [o for o in outcomes if not o.ok]
    assert cut, "no stream outlived the drain deadline"
    assert [o for o in cut if not o.clean_error_event] == []
    assert {(o.error or {}).get("type") for o in cut} == {"upstream_error"}
    # Cut by the deadline (plus the stop's grace), not run to their end.
    assert max(o.ended - o.started for o in cut) < 10



def test_a_rolling_restart_fails_no_request_through_a_gateway_in_another_process(
        tmp_path: Path) -> None:
    # The other gateway learns the route table through Redis, a moment after the controller.
    with private_redis() as redis, running_fleet(
            tmp_path, TOKEN_INTERVAL_MS, gateways_beside=1, REDIS_URL=redis.url) as fleet:
        fleet.deploy("chat", 2)
        [gateway] = fleet.gateways
        wait_until("the other gateway routing both replicas", lambda: any(
            m["id"] == "chat" and m["ready_replicas"] == 2
            for m in Api(gateway, fleet.api.key).get("/v1/models")["data"]), 30)
        traffic = fleet.traffic("chat", url=gateway).start()
        try:
            restart_then_scale_down(fleet, traffic)
        finally:
            outcomes = traffic.stop()
    assert [o for o in outcomes if not o.ok] == []
    assert {o.label for o in outcomes} == {"steady", "restart", "scale-down"}
