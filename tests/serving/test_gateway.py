"""The gateway with the official `openai` client, in front of FAKE engines (fakes/engine.py)
where many replicas or failures are needed. The same client against the real vLLM server is
in test_gateway_vllm.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from serving.models import ApiKey, UsageRecord
from serving.services import revoke_api_key
from tests.factories import make_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture
def key() -> str:
    return make_api_key(ApiKey.Scope.INFERENCE)


def test_a_streamed_chat_arrives_chunk_by_chunk_and_ends_cleanly(
    gateway_url: str, key: str, fake_engines: Engines
) -> None:
    publish("demo", [fake_engines("demo-1")])
    stream = client(gateway_url, key).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
        stream=True)
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 20
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage


def test_usage_is_passed_on_when_the_client_asks(gateway_url: str, key: str,
                                                 fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    stream = client(gateway_url, key).completions.create(
        model="fake", prompt="hi", max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage]
    assert usage[0].completion_tokens == 7


def test_a_deployment_name_or_alias_reaches_the_served_model(gateway_url: str, key: str,
                                                             fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")], names=("fake", "demo", "my-alias"))
    answer = client(gateway_url, key).completions.create(model="my-alias", prompt="hi",
                                                         max_tokens=3)
    assert answer.choices[0].text == " tok" * 3


def test_models_lists_what_the_route_table_serves(gateway_url: str, key: str,
                                                  fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    ids = {m.id for m in client(gateway_url, key).models.list()}
    assert ids == {"fake", "demo"}


def test_the_request_id_is_kept_or_made(gateway_url: str, key: str,
                                        fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    given = httpx.post(f"{gateway_url}/v1/completions", json=body,
                       headers={**headers, "X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = httpx.post(f"{gateway_url}/v1/completions", json=body, headers=headers)
    assert len(made.headers["x-request-id"]) == 32
    too_long = httpx.post(f"{gateway_url}/v1/completions", json=body,
                          headers={**headers, "X-Request-Id": "x" * 201})
    assert too_long.status_code == 200 and len(too_long.headers["x-request-id"]) == 32


def test_usage_records_are_written_in_batches(gateway_url: str, key: str,
                                              fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    openai_client = client(gateway_url, key)
    for _ in range(3):
        openai_client.completions.create(model="fake", prompt="hi", max_tokens=4)
    mine = UsageRecord.objects.filter(key=ApiKey.objects.get())
    deadline = time.monotonic() + 10
    while mine.count() < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    records = list(mine)
    assert len(records) == 3
    assert {r.completion_tokens for r in records} == {4}
    assert {r.deployment for r in records} == {"demo"}
    assert all(r.e2e_ms > 0 and r.replica == "demo-1" for r in records)


def test_requests_spread_over_replicas(gateway_url: str, key: str,
                                       fake_engines: Engines) -> None:
    engines = [fake_engines("demo-1"), fake_engines("demo-2")]
    publish("demo", engines, policy="round-robin")
    openai_client = client(gateway_url, key)
    for _ in range(4):
        openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)
    assert [e.metric("fake:requests_total") for e in engines] == [2, 2]


# --- bad input: every error in OpenAI's shape, raised by the client as the right class ---


def test_a_missing_key_is_401(gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    response = httpx.post(f"{gateway_url}/v1/completions",
                          json={"model": "fake", "prompt": "hi"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


def test_a_wrong_key_is_an_authentication_error(gateway_url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(gateway_url, "fp-wrong").models.list()


def test_a_revoked_key_is_refused_at_once(gateway_url: str, key: str,
                                          fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    openai_client = client(gateway_url, key)
    openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)
    revoke_api_key(ApiKey.objects.get())
    with pytest.raises(openai.AuthenticationError):
        openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)


def test_a_key_not_allowed_for_the_model_is_403(gateway_url: str,
                                                fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    key = make_api_key(ApiKey.Scope.INFERENCE)
    ApiKey.objects.update(allowed_models=["other"])
    with pytest.raises(openai.PermissionDeniedError):
        client(gateway_url, key).completions.create(model="fake", prompt="hi", max_tokens=1)


def test_an_unknown_model_is_404(gateway_url: str, key: str) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client(gateway_url, key).completions.create(model="nope", prompt="hi")
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize(("arguments", "param"), [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": 7}, "temperature"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "extra_body": {"n": "two"}}, "n"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_parameters_are_bad_requests_naming_the_field(
    gateway_url: str, key: str, arguments: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client(gateway_url, key).completions.create(model="fake", **arguments)
    assert error.value.param == param


@pytest.mark.parametrize(("body", "param"), [({"model": "fake"}, "prompt"),
                                             ({"prompt": "hi"}, "model")])
def test_missing_fields_are_400_naming_the_field(gateway_url: str, key: str,
                                                 body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{gateway_url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_the_client_raises_bad_request_for_invalid_parameters(gateway_url: str,
                                                              key: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client(gateway_url, key).chat.completions.create(model="fake", messages=[])


def test_malformed_json_is_400(gateway_url: str, key: str) -> None:
    response = httpx.post(f"{gateway_url}/v1/chat/completions", content=b"{nope",
                          headers={"Authorization": f"Bearer {key}",
                                   "Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_a_body_over_the_limit_is_413(gateway_url: str, key: str, settings: Any) -> None:
    settings.GATEWAY_MAX_BODY_BYTES = 4096
    with pytest.raises(openai.APIStatusError) as error:
        client(gateway_url, key).completions.create(model="fake", prompt="x" * 10_000)
    assert error.value.status_code == 413
    assert error.value.body["code"] == "request_too_large"  # type: ignore[index]


def test_no_ready_replica_is_503_with_retry_after(gateway_url: str, key: str) -> None:
    publish("demo", [])
    with pytest.raises(openai.InternalServerError) as error:
        client(gateway_url, key).completions.create(model="fake", prompt="hi")
    assert error.value.status_code == 503
    assert error.value.response.headers["retry-after"] == "2"


# --- failures ------------------------------------------------------------------------


def test_a_dead_replica_before_the_first_byte_is_retried_on_another(
    gateway_url: str, key: str, fake_engines: Engines
) -> None:
    dead, alive = fake_engines("dead-1"), fake_engines("alive-1")
    dead.process.kill()
    dead.process.wait()
    publish("demo", [dead, alive], policy="round-robin")
    openai_client = client(gateway_url, key)
    for _ in range(4):
        answer = openai_client.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert answer.choices[0].text == " tok tok"
    metrics = httpx.get(f"{gateway_url}/metrics").text
    assert 'fleetplane_gateway_retries_total{model="fake"}' in metrics


def test_killing_the_replica_a_stream_is_on_ends_that_stream_with_an_error_event(
    gateway_url: str, key: str, fake_engines: Engines
) -> None:
    first = fake_engines("kill-1", interval_ms=20)
    second = fake_engines("kill-2", interval_ms=20)
    publish("demo", [first, second], policy="round-robin")
    events: list[str] = []
    with httpx.stream("POST", f"{gateway_url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "fake", "prompt": "hi", "max_tokens": 500,
                            "stream": True}) as response:
        victim = first if first.metric("vllm:num_requests_running") else second
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 5:
                victim.process.kill()
    assert '"type":"upstream_error"' in events[-1]
    assert len(events) < 500
    survivor = second if victim is first else first
    answer = client(gateway_url, key).completions.create(model="fake", prompt="hi",
                                                         max_tokens=2)
    assert answer.choices[0].text == " tok tok"
    assert survivor.metric("vllm:num_requests_running") == 0


def test_a_replica_that_falls_silent_mid_stream_ends_it_with_an_error_event(
    gateway_url: str, key: str, fake_engines: Engines, settings: Any
) -> None:
    # A stopped process keeps its socket open: only the idle limit tells.
    settings.GATEWAY_UPSTREAM_IDLE_SECONDS = 1
    first = fake_engines("silent-1", interval_ms=20)
    second = fake_engines("silent-2", interval_ms=20)
    publish("demo", [first, second], policy="round-robin")
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{gateway_url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "fake", "prompt": "hi", "max_tokens": 500,
                                "stream": True}) as response:
            victim = first if first.metric("vllm:num_requests_running") else second
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 5:
                    os.kill(victim.process.pid, signal.SIGSTOP)
                    stopped = time.monotonic()
        ended = time.monotonic() - stopped
        # The silent replica sits out: the next stream goes to the other one at once.
        started = time.monotonic()
        answer = client(gateway_url, key).completions.create(model="fake", prompt="hi",
                                                             max_tokens=2)
        answered_in = time.monotonic() - started
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
    assert '"type":"upstream_error"' in events[-1] and "sent nothing for 1 s" in events[-1]
    assert len(events) < 500
    # The limit, not the stream's length (10 s). It runs from the last byte the gateway
    # heard, which can come a little before this test's clock starts at the stop.
    assert 0.9 <= ended < 10
    assert answer.choices[0].text == " tok tok"
    assert answered_in < 1  # not first sent to the silent replica


def test_a_stream_a_silent_replica_does_not_start_is_answered_by_another(
    gateway_url: str, key: str, fake_engines: Engines, settings: Any
) -> None:
    settings.GATEWAY_UPSTREAM_IDLE_SECONDS = 1
    silent, alive = fake_engines("mute-1"), fake_engines("mute-2")
    os.kill(silent.process.pid, signal.SIGSTOP)
    try:
        publish("demo", [silent, alive], policy="round-robin")
        texts = []
        for _ in range(2):
            stream = client(gateway_url, key).completions.create(
                model="fake", prompt="hi", max_tokens=2, stream=True)
            texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    finally:
        os.kill(silent.process.pid, signal.SIGCONT)
    assert texts == [" tok tok", " tok tok"]
    assert alive.metric("fake:requests_total") == 2
    metrics = httpx.get(f"{gateway_url}/metrics").text
    assert 'fleetplane_gateway_retries_total{model="fake"}' in metrics


def test_a_client_that_disconnects_cancels_its_upstream_request(
    gateway_url: str, key: str, fake_engines: Engines
) -> None:
    engine = fake_engines("demo-1", interval_ms=50)
    publish("demo", [engine])
    with httpx.stream("POST", f"{gateway_url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}",
                               "X-Request-Id": "leaves-mid-stream"},
                      json={"model": "fake", "prompt": "hi", "max_tokens": 400,
                            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 5
    while engine.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.metric("vllm:num_requests_running") == 0
    assert engine.metric("fake:client_disconnects_total") == 1
    records = UsageRecord.objects.filter(request_id="leaves-mid-stream")
    while not records.exists() and time.monotonic() < deadline + 5:
        time.sleep(0.1)
    record = records.get()
    assert record.status == 499 and record.replica == "demo-1"


def test_concurrent_streams_all_complete(gateway_url: str, key: str,
                                         fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1"), fake_engines("demo-2")])
    results: list[str] = []

    def one() -> None:
        stream = client(gateway_url, key).completions.create(
            model="fake", prompt="hi", max_tokens=50, stream=True)
        results.append("".join(c.choices[0].text for c in stream if c.choices))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [" tok" * 50] * 16


def test_a_key_revoked_in_another_process_is_refused_through_redis(
    gateway_url: str, key: str, fake_engines: Engines, settings: Any
) -> None:
    import redis

    from serving import keys

    settings.REDIS_URL = "redis://127.0.0.1:6379/7"
    settings.GATEWAY_LOAD_SCRAPE_SECONDS = 0.2
    publish("demo", [fake_engines("redis-1")])
    openai_client = client(gateway_url, key)
    openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)
    # The watcher has read this Redis's keys version (a first sight clears the cache too).
    current = redis.Redis.from_url(settings.REDIS_URL).get(keys.KEYS_VERSION_KEY)
    deadline = time.monotonic() + 10
    while keys._seen_version[0] != current:
        assert time.monotonic() < deadline, "the watcher never read the keys' version"
        time.sleep(0.05)
    openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)  # cached now
    # Another process revokes the key: this process only hears of it through Redis.
    ApiKey.objects.filter(key_hash=ApiKey.objects.get().key_hash).update(
        revoked_at="2026-01-01T00:00:00Z")
    openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)  # cached
    redis.Redis.from_url(settings.REDIS_URL).incr(keys.KEYS_VERSION_KEY)
    deadline = time.monotonic() + 10
    while True:
        try:
            openai_client.completions.create(model="fake", prompt="hi", max_tokens=1)
        except openai.AuthenticationError:
            break  # refused once the watcher saw the change
        assert time.monotonic() < deadline, "the revocation never reached this process"
        time.sleep(0.1)
