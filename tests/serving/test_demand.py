"""Requests held at the gateway for a deployment with no ready replica show on /metrics
as `fleetplane_gateway_cold_start_waiting_requests{deployment}`: the gauge KEDA's
activation trigger reads to wake a deployment it scaled to zero."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.models import ApiKey
from serving.routes import DeploymentRoutes, build_table, routes
from tests.factories import make_api_key

pytestmark = pytest.mark.django_db(transaction=True)

GAUGE = "fleetplane_gateway_cold_start_waiting_requests"


def held(gateway_url: str, deployment: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == GAUGE and sample.labels.get("deployment") == deployment:
                return float(sample.value)
    return 0.0


def wait_for(check: Callable[[], bool], what: str, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


def test_a_request_held_for_a_deployment_at_zero_is_counted_until_it_ends(
        gateway_url: str, settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    settings.GATEWAY_COLD_START_WAIT_SECONDS = 3.0
    key = make_api_key(ApiKey.Scope.INFERENCE)
    routes.publish(build_table([DeploymentRoutes(deployment="sleepy", served_model_name="sleepy",
                                     policy="least-load", max_model_len=None, replicas=(),
                                     wakes=True)]))
    answers: list[int] = []

    def ask() -> None:
        answers.append(httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                                  headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "sleepy", "prompt": "hi",
                                        "max_tokens": 1}).status_code)

    asking = [threading.Thread(target=ask) for _ in range(2)]
    for thread in asking:
        thread.start()
    wait_for(lambda: held(gateway_url, "sleepy") == 2, "two requests held")
    for thread in asking:
        thread.join(timeout=30)
    assert answers == [503, 503]  # no replica came up within the wait
    assert held(gateway_url, "sleepy") == 0
