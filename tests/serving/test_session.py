"""The data plane's one public API (serving/session.py): an HTTP request and a playground
generation go through the same `gateway.session(call)`, so they leave the same accounts:
metrics, usage records, the replica's in-flight count and the admission slot. The
gateway's ASGI application and the playground run in this test's event loop, in front of
a FAKE engine (fakes/engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from serving import metrics, playground
from serving.gateway import gateway
from serving.models import UsageRecord
from serving.services import create_api_key
from tests.engines import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

QUESTION = [{"role": "user", "content": "Count."}]


def sample(metric: Any, *labels: str) -> float:
    return float(metrics.child(metric, *labels)._value.get())


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),  # type: ignore[arg-type]
                                 base_url="http://gateway.test", timeout=30) as client:
        yield client


async def generate(message: dict[str, Any], user: str = "ada") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def emit(item: dict[str, Any]) -> None:
        sent.append(item)

    await playground.generate("a", playground.prepare(message), user, emit)
    return sent


async def written_records() -> list[UsageRecord]:
    writer = gateway.usage
    assert writer is not None
    await writer.flush()
    return await sync_to_async(lambda: list(UsageRecord.objects.order_by("id")))()


async def test_http_and_playground_leave_the_same_accounts(
        fake_engines: Callable[..., FakeEngine], client: httpx.AsyncClient) -> None:
    publish("demo", [fake_engines("e1", interval_ms=1)])
    record, key = await sync_to_async(create_api_key)("k", "inference")
    before = {model: sample(metrics.REQUESTS, model, "demo", "200")
              for model in ("fake", "demo")}
    answer = await client.post("/v1/chat/completions", headers={
        "Authorization": f"Bearer {key}"}, json={"model": "fake", "messages": QUESTION,
                                                   "max_tokens": 7, "stream": True})
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    sent = await generate({"deployment": "demo", "max_tokens": 7, "messages": QUESTION})
    assert sent[0]["type"] == "started" and sent[-1]["type"] == "done"

    # One request each, counted under the name each used (the HTTP client's model name,
    # the playground's deployment), and nothing left in flight or holding a slot.
    assert sample(metrics.REQUESTS, "fake", "demo", "200") == before["fake"] + 1
    assert sample(metrics.REQUESTS, "demo", "demo", "200") == before["demo"] + 1
    assert sample(metrics.IN_FLIGHT, "fake", "demo") == 0
    assert sample(metrics.IN_FLIGHT, "demo", "demo") == 0
    assert gateway.router.state("e1").in_flight == 0
    assert gateway.admission.lane("demo|all").busy == 0
    http, played = await written_records()
    assert (http.key_id, http.username) == (record.pk, "")
    assert (played.key_id, played.username) == (None, "ada")
    for usage in (http, played):
        assert (usage.deployment, usage.replica, usage.status, usage.stream) == (
            "demo", "e1", 200, True)
        assert (usage.prompt_tokens, usage.completion_tokens) == (5, 7)
        assert usage.ttft_ms is not None and usage.e2e_ms >= usage.ttft_ms


async def test_a_stopped_generation_is_recorded_as_499_and_frees_its_slot(
        fake_engines: Callable[..., FakeEngine]) -> None:
    engine = fake_engines("e1", interval_ms=50)
    publish("demo", [engine])
    sent: list[dict[str, Any]] = []
    first_token = asyncio.Event()

    async def emit(item: dict[str, Any]) -> None:
        sent.append(item)
        if item["type"] == "token":
            first_token.set()

    generation = playground.prepare({"deployment": "demo", "max_tokens": 200,
                                     "messages": QUESTION})
    task = asyncio.ensure_future(playground.generate("a", generation, "ada", emit))
    await asyncio.wait_for(first_token.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent[-1] == {"type": "stopped", "id": "a"}
    assert gateway.router.state("e1").in_flight == 0
    assert gateway.admission.lane("demo|all").busy == 0
    [usage] = await written_records()
    assert (usage.status, usage.username, usage.replica) == (499, "ada", "e1")


async def test_a_stopped_generation_is_recorded_with_the_tokens_streamed(
        fake_engines: Callable[..., FakeEngine]) -> None:
    publish("demo", [fake_engines("e1", interval_ms=20)], running_usage=True)
    tokens: list[str] = []
    third = asyncio.Event()

    async def emit(item: dict[str, Any]) -> None:
        if item["type"] == "token":
            tokens.append(item["text"])
            if len(tokens) == 3:
                third.set()

    generation = playground.prepare({"deployment": "demo", "max_tokens": 200,
                                     "messages": QUESTION})
    task = asyncio.ensure_future(playground.generate("a", generation, "ada", emit))
    await asyncio.wait_for(third.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [usage] = await written_records()
    assert (usage.status, usage.prompt_tokens) == (499, 5)
    assert usage.completion_tokens == len("".join(tokens).split())


def test_the_playground_refuses_an_embedding_model() -> None:
    publish("vectors", [], task="embed")
    with pytest.raises(playground.PlaygroundError, match="serves an embedding model"):
        playground.prepare({"deployment": "vectors", "messages": QUESTION})


async def test_a_refusal_is_recorded_once_whichever_way_the_call_came(
        fake_engines: Callable[..., FakeEngine], client: httpx.AsyncClient) -> None:
    publish("demo", [])  # no ready replica, and no wake path: 503 at once
    _, key = await sync_to_async(create_api_key)("k", "inference")
    answer = await client.post("/v1/chat/completions", headers={
        "Authorization": f"Bearer {key}"}, json={"model": "fake", "messages": QUESTION})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"
    sent = await generate({"deployment": "demo", "messages": QUESTION})
    assert sent == [{"type": "error", "id": "a",
                     "message": "no ready replica for model `demo`"}]
    http, played = await written_records()
    assert (http.status, http.replica, played.status, played.replica) == (503, "", 503, "")
