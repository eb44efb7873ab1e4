"""A replica's chunks that need no change pass through the gateway as they came (the
server's write_chunks, serving/upstream/connection.py): the official `openai` client and
httpx in front of paced FAKE engines (each token its own read), through the in-process
gateway and its own HTTP protocol. What a client and an operator see must not change: every
token in order, the usage event as asked, the inter-token latency recorded, and a client
that leaves a stream charged for the tokens it was sent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from serving.gateway.relay import EventRelay
from serving.models import ApiKey, UsageRecord
from serving.services import create_api_key
from tests.factories import make_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]


@pytest.fixture
def passed(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The chunks the gateway passed on unchanged (its relay runs in this process)."""
    taken: list[bytes] = []
    take_chunks = EventRelay.take_chunks

    def counted(self: EventRelay, chunks: bytes) -> bool:
        if take_chunks(self, chunks):
            taken.append(chunks)
            return True
        return False

    monkeypatch.setattr(EventRelay, "take_chunks", counted)
    return taken


def records(request_id: str) -> Any:
    found = UsageRecord.objects.filter(request_id=request_id)
    deadline = time.monotonic() + 10
    while not found.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return found.get()


def test_a_paced_stream_passes_through_whole_and_timed(
        gateway_url: str, fake_engines: Engines, passed: list[bytes]) -> None:
    publish("demo", [fake_engines("chunks-1", interval_ms=5)])
    key = make_api_key(ApiKey.Scope.INFERENCE)
    stream = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0,
                           timeout=30).completions.create(
        model="fake", prompt="hi", max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "paced"})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 40
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [40]  # once, at the end
    # Most tokens went through unchanged, the first and the usage event through the parser.
    assert 20 <= sum(chunk.count(b"data: {") for chunk in passed) < 40
    record = records("paced")
    assert record.status == 200 and record.completion_tokens == 40
    assert record.itl_ms is not None and 3 < record.itl_ms < 50  # 5 ms a token


def test_the_usage_event_is_taken_out_when_not_asked_for(
        gateway_url: str, fake_engines: Engines, passed: list[bytes]) -> None:
    publish("demo", [fake_engines("chunks-2", interval_ms=5)])
    key = make_api_key(ApiKey.Scope.INFERENCE)
    with httpx.stream("POST", f"{gateway_url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "fake", "prompt": "hi", "max_tokens": 30,
                            "stream": True}) as response:
        body = response.read()
    assert body.count(b'"text":" tok"') == 30 and b'"usage"' not in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert passed  # the tokens between went through unchanged


def test_a_client_that_leaves_a_stream_pays_for_the_tokens_it_was_sent(
        gateway_url: str, fake_engines: Engines, passed: list[bytes]) -> None:
    publish("demo", [fake_engines("chunks-3", interval_ms=5)])
    _, key = create_api_key("leaver", "inference", tpm=1000)
    read = 0
    with httpx.stream("POST", f"{gateway_url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}", "X-Request-Id": "leaver"},
                      json={"model": "fake", "prompt": "hi", "max_tokens": 900,
                            "stream": True}) as response:
        for line in response.iter_lines():
            read += line.startswith("data: {")
            if read == 250:
                break
    assert records("leaver").status == 499
    assert passed
    # Charged for the 250 or more tokens relayed, not for none: 898 more do not fit.
    refused = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                         headers={"Authorization": f"Bearer {key}"},
                         json={"model": "fake", "prompt": "hi", "max_tokens": 898})
    assert refused.status_code == 429
    # and not for the whole reservation: 600 do.
    assert httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "fake", "prompt": "hi",
                            "max_tokens": 600}).status_code == 200
