"""What one caller can hold at the gateway, so no tenant can crowd out the others: its
requests in flight, its share of a class's queue, the size of an answer relayed in one
piece, and its running streams once its key is revoked. Against FAKE engines."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from serving.services import create_api_key, revoke_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]


def post(url: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def wait_until(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@contextmanager
def streaming(url: str, key: str, max_tokens: int = 200) -> Iterator[Iterator[str]]:
    """A completion streamed in the background of the test; yields its lines."""
    body = {"model": "fake", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        yield response.iter_lines()


def test_a_key_holds_at_most_its_requests_in_flight(
        gateway_url: str, fake_engines: Engines, settings: Any) -> None:
    publish("demo", [fake_engines("limits-1", interval_ms=50)])
    settings.GATEWAY_KEY_MAX_IN_FLIGHT = 2
    _, busy = create_api_key("busy", "inference")
    _, other = create_api_key("other", "inference")
    small = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    with streaming(gateway_url, busy), streaming(gateway_url, busy):
        refused = post(gateway_url, busy, small)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_requests_in_flight"
        assert refused.headers["retry-after"] == "1"
        assert post(gateway_url, other, small).status_code == 200  # others unaffected
    assert post(gateway_url, busy, small).status_code == 200  # once its streams ended


def test_one_key_cannot_fill_a_class_queue(
        gateway_url: str, fake_engines: Engines, settings: Any) -> None:
    from serving.gateway import gateway
    from serving.priority import parse_classes

    settings.PRIORITY_CLASSES = parse_classes('{"standard": {"level": 10, "max_queued": 4}}')
    settings.GATEWAY_KEY_QUEUE_SHARE = 0.5  # two places of four per key
    publish("demo", [fake_engines("limits-1", interval_ms=20)], replica_concurrency=1)
    _, greedy = create_api_key("greedy", "inference")
    _, polite = create_api_key("polite", "inference")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 50}  # about 1 s each
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(post(gateway_url, greedy,
                                                                   body)))
               for _ in range(3)]
    for thread in threads:
        thread.start()  # one runs, two wait
    wait_until(lambda: gateway.admission.queued("demo") == {"standard": 2})
    refused = post(gateway_url, greedy, body)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "key_queue_full"
    assert post(gateway_url, polite, body).status_code == 200  # its place was kept
    for thread in threads:
        thread.join(timeout=30)
    assert [a.status_code for a in answers] == [200, 200, 200]


def test_a_non_streamed_answer_over_the_limit_is_refused_in_openais_shape(
        gateway_url: str, fake_engines: Engines, settings: Any) -> None:
    publish("demo", [fake_engines("limits-1", interval_ms=0)])
    settings.GATEWAY_MAX_RESPONSE_BYTES = 2048
    _, key = create_api_key("big", "inference")
    huge = post(gateway_url, key, {"model": "fake", "prompt": "hi", "max_tokens": 2000})
    assert huge.status_code == 502
    error = huge.json()["error"]
    assert error["code"] == "response_too_large" and "2048 bytes" in error["message"]
    assert post(gateway_url, key, {"model": "fake", "prompt": "hi", "max_tokens": 2}
                ).status_code == 200


def test_running_streams_of_a_revoked_key_end_and_others_go_on(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("limits-1", interval_ms=50)])
    record, revoked = create_api_key("leaving", "inference")
    _, staying = create_api_key("staying", "inference")
    with streaming(gateway_url, revoked) as cut, streaming(gateway_url, staying) as kept:
        assert next(cut).startswith("data: {") and next(kept).startswith("data: {")
        revoke_api_key(record)
        started = time.monotonic()
        rest = [line for line in cut if line]  # ends well before its 10 s of tokens
        assert time.monotonic() - started < 3
        assert '"code":"api_key_revoked"' in rest[-1]
        assert next(line for line in kept if line).startswith("data: {")  # still going
