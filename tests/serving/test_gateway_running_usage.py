"""What a stream is charged, and which endpoints a model's task answers, in front of FAKE
engines (fakes/engine.py gives vLLM's `continuous_usage_stats`: the usage so far on every
chunk). The same against the real vLLM server: test_accounting_vllm.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from serving.models import ApiKey, UsageRecord
from tests.factories import make_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]


@pytest.fixture
def key() -> str:
    return make_api_key(ApiKey.Scope.INFERENCE)


def record_of(request_id: str) -> UsageRecord:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = UsageRecord.objects.filter(request_id=request_id).first()
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no usage record for {request_id}")


def read_events(gateway_url: str, key: str, body: dict[str, object], request_id: str,
                keep: int | None = None) -> list[dict[str, object]]:
    """The stream's JSON events as the client gets them; with `keep`, the client leaves
    after that many."""
    events: list[dict[str, object]] = []
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", timeout=30, json=body,
                      headers={"Authorization": f"Bearer {key}",
                               "X-Request-Id": request_id}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == keep:
                    break
    return events


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_stream_the_client_leaves_is_recorded_with_the_tokens_relayed(
        gateway_url: str, key: str, fake_engines: Engines) -> None:
    engine = fake_engines("demo-1", interval_ms=20)
    publish("demo", [engine], running_usage=True)
    events = read_events(gateway_url, key, {**CHAT, "max_tokens": 400}, "left-after-5",
                         keep=5)
    assert all("usage" not in event for event in events)  # not asked for: taken out
    record = record_of("left-after-5")
    assert (record.status, record.prompt_tokens) == (499, 5)
    # What was relayed: the five the client read, and any already on their way to it.
    assert 5 <= record.completion_tokens < 400  # type: ignore[operator]
    deadline = time.monotonic() + 5
    while engine.metric("fake:client_disconnects_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metric("fake:client_disconnects_total") == 1


def test_a_finished_stream_is_recorded_with_the_final_usage(
        gateway_url: str, key: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")], running_usage=True)
    events = read_events(gateway_url, key, {**CHAT, "max_tokens": 7,
                                            "stream_options": {"include_usage": True}},
                         "whole-stream")
    assert [e["usage"] for e in events if "usage" in e] == [
        {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}]
    record = record_of("whole-stream")
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (200, 5, 7)


def test_the_usage_so_far_is_passed_on_when_the_client_asks_for_it(
        gateway_url: str, key: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")], running_usage=True)
    events = read_events(gateway_url, key, {**CHAT, "max_tokens": 3, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, "running-asked")
    running = [e["usage"]["completion_tokens"] for e in events  # type: ignore[index]
               if e.get("choices") and "usage" in e]
    assert running == [1, 2, 3]


def test_a_stream_left_by_a_client_that_asked_for_the_usage_so_far_is_recorded_too(
        gateway_url: str, key: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1", interval_ms=20)], running_usage=True)
    events = read_events(gateway_url, key, {**CHAT, "max_tokens": 400, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, "left-asking", keep=4)
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4]  # type: ignore[index]
    record = record_of("left-asking")
    assert (record.status, record.prompt_tokens) == (499, 5)
    assert 4 <= record.completion_tokens < 400  # type: ignore[operator]


def test_a_model_answers_only_the_endpoints_of_its_task(
        gateway_url: str, key: str, fake_engines: Engines) -> None:
    engine = fake_engines("demo-1")
    publish("chat", [engine], served="fake", names=("fake",))
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0,
                           timeout=30)
    with pytest.raises(openai.BadRequestError, match="generates text") as refused:
        client.embeddings.create(model="fake", input="hello")
    assert refused.value.code == "model_not_embedding"
    publish("vectors", [engine], served="fake", names=("fake",), task="embed")
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as refused:
        client.chat.completions.create(model="fake",
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_not_generative"
    empties: list[Any] = [[], "", ["fine", ""], [[]]]
    for empty in empties:
        with pytest.raises(openai.BadRequestError, match="must not be empty"):
            client.embeddings.create(model="fake", input=empty)
