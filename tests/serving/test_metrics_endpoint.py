"""/metrics with and without METRICS_TOKEN, and its gateway series after real traffic
(FAKE engines, fakes/engine.py, through the official `openai` client), over HTTP to the
ASGI application in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from serving.models import ApiKey
from tests.factories import make_api_key
from tests.processes import free_port
from tests.serving.conftest import FakeEngine, publish

Engines = Callable[..., FakeEngine]


def test_metrics_need_the_bearer_token_when_one_is_set(gateway_url: str,
                                                       settings: Any) -> None:
    settings.METRICS_TOKEN = "scrape-me-0123456789"
    anonymous = httpx.get(f"{gateway_url}/metrics", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert "fleetplane_" not in anonymous.text
    wrong = httpx.get(f"{gateway_url}/metrics", timeout=10,
                      headers={"Authorization": "Bearer scrape-me-0123456788"})
    assert wrong.status_code == 401
    scraped = httpx.get(f"{gateway_url}/metrics", timeout=10,
                        headers={"Authorization": "Bearer scrape-me-0123456789"})
    assert scraped.status_code == 200
    assert "fleetplane_gateway_requests_total" in scraped.text


def test_metrics_are_open_without_a_token(gateway_url: str, settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    assert httpx.get(f"{gateway_url}/metrics", timeout=10).status_code == 200


def test_metrics_take_the_bearer_scheme_in_any_case(gateway_url: str, settings: Any) -> None:
    settings.METRICS_TOKEN = "scrape-me-0123456789"
    for scheme in ("bearer", "BEARER", "Bearer"):
        scraped = httpx.get(f"{gateway_url}/metrics", timeout=10,
                            headers={"Authorization": f"{scheme} scrape-me-0123456789"})
        assert (scheme, scraped.status_code) == (scheme, 200)
    for given in ("Basic scrape-me-0123456789", "bearer SCRAPE-ME-0123456789",
                  "scrape-me-0123456789"):
        refused = httpx.get(f"{gateway_url}/metrics", timeout=10,
                            headers={"Authorization": given})
        assert (given, refused.status_code) == (given, 401)


# --- the series themselves, after real traffic through the gateway -----------------------

Sample = tuple[str, frozenset[tuple[str, str]]]


def scrape(url: str) -> dict[Sample, float]:
    """Every sample of /metrics, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def moved(before: dict[Sample, float], after: dict[Sample, float], name: str,
          **labels: str) -> float:
    """How far one series moved between two scrapes (0 for one not there yet)."""
    sample = (name, frozenset(labels.items()))
    return after.get(sample, 0.0) - before.get(sample, 0.0)


@pytest.fixture
def key(db: None) -> str:
    return make_api_key(ApiKey.Scope.INFERENCE)


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.django_db(transaction=True)
def test_answered_requests_move_the_request_latency_and_token_series(
    gateway_url: str, key: str, fake_engines: Engines, settings: Any
) -> None:
    settings.METRICS_TOKEN = ""
    publish("series-demo", [fake_engines("series-1", model="series-model")],
            served="series-model")
    before = scrape(gateway_url)
    client = openai_client(gateway_url, key)
    for _ in range(3):
        for _ in client.completions.create(model="series-model", prompt="hi", max_tokens=5,
                                           stream=True):
            pass
    for _ in range(2):
        client.completions.create(model="series-model", prompt="hi", max_tokens=3)
    after = scrape(gateway_url)
    model = {"model": "series-model"}
    assert moved(before, after, "fleetplane_gateway_requests_total", status="200",
                 deployment="series-demo", **model) == 5
    for histogram in ("time_to_first_token_seconds", "request_duration_seconds"):
        name = f"fleetplane_gateway_{histogram}"
        assert moved(before, after, f"{name}_count", **model) == 5
        assert moved(before, after, f"{name}_bucket", le="+Inf", **model) == 5
        assert moved(before, after, f"{name}_bucket", le="60.0", **model) == 5
        assert moved(before, after, f"{name}_sum", **model) > 0
    itl = "fleetplane_gateway_inter_token_latency_seconds"
    assert moved(before, after, f"{itl}_count", **model) >= 3  # each stream's chunks
    assert moved(before, after, f"{itl}_sum", **model) > 0
    # The FAKE engine counts 5 prompt tokens a request; every completion token is one.
    assert moved(before, after, "fleetplane_gateway_tokens_total", kind="completion",
                 **model) == 3 * 5 + 2 * 3
    assert moved(before, after, "fleetplane_gateway_tokens_total", kind="prompt",
                 **model) == 5 * 5
    assert moved(before, after, "fleetplane_gateway_in_flight_requests",
                 deployment="series-demo", **model) == 0


@pytest.mark.django_db(transaction=True)
def test_a_replica_that_fails_moves_the_error_series(gateway_url: str, key: str,
                                                     settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    dead = FakeEngine("series-dead", f"http://127.0.0.1:{free_port()}", None)  # type: ignore[arg-type]
    publish("series-broken", [dead], served="series-broken")
    before = scrape(gateway_url)
    with pytest.raises(openai.InternalServerError):
        openai_client(gateway_url, key).completions.create(model="series-broken",
                                                           prompt="hi", max_tokens=2)
    after = scrape(gateway_url)
    labels = {"model": "series-broken", "deployment": "series-broken"}
    assert moved(before, after, "fleetplane_gateway_upstream_errors_total", **labels) >= 1
    assert moved(before, after, "fleetplane_gateway_requests_total", status="503",
                 **labels) == 1


@pytest.mark.django_db(transaction=True)
def test_a_request_waiting_for_a_slot_shows_in_the_queue_gauge(
    gateway_url: str, key: str, fake_engines: Engines, settings: Any
) -> None:
    settings.METRICS_TOKEN = ""
    publish("series-queue", [fake_engines("series-q", model="series-q", interval_ms=20)],
            served="series-q", replica_concurrency=1)
    queued = ("fleetplane_gateway_queued_requests",
              frozenset({"deployment": "series-queue", "priority": "standard"}.items()))
    in_flight = ("fleetplane_gateway_in_flight_requests",
                 frozenset({"model": "series-q", "deployment": "series-queue"}.items()))
    before = scrape(gateway_url)
    answers: list[str] = []

    def one() -> None:
        # Streams: a stream is in flight from its first byte (a whole answer only once
        # the engine has made it).
        chunks = openai_client(gateway_url, key).completions.create(
            model="series-q", prompt="hi", max_tokens=60, stream=True)
        answers.append("".join(c.choices[0].text for c in chunks if c.choices))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    # One at the replica (in flight once its answer has begun), one waiting for its slot.
    while ((seen := scrape(gateway_url)).get(queued), seen.get(in_flight)) != (1, 1):
        assert time.monotonic() < deadline, \
            f"never one queued beside one in flight: {seen.get(queued)}, {seen.get(in_flight)}"
        time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=60)
    after = scrape(gateway_url)
    assert answers == [" tok" * 60] * 2
    assert after[queued] == 0
    assert after[in_flight] == 0
    # Observed for the request that waited (one that found a free slot did not queue).
    assert moved(before, after, "fleetplane_gateway_queue_wait_seconds_count",
                 deployment="series-queue", priority="standard") == 1
    assert moved(before, after, "fleetplane_gateway_queue_wait_seconds_sum",
                 deployment="series-queue", priority="standard") > 0
