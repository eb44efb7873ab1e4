"""OpenAI compatibility: the official `openai` client, unchanged, through the gateway to the
real vLLM CPU server with the real demo model.

The demo model's greedy answers depend on the CPU's numerics (one machine answers "Paris",
another "L'Étoile, la Marseillaise, ..."): these tests compare the gateway's answer with
the replica's own answer to the same request, never with what the model is expected to
know."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from serving.models import ApiKey
from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from tests.factories import make_api_key

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MODEL = "smollm2"


@pytest.fixture
def key(vllm_url: str) -> str:
    routes.publish(build_table([DeploymentRoutes(deployment="smollm2", served_model_name=MODEL,
                                     policy="least-load", max_model_len=1024,
                                     replicas=(RouteReplica("smollm2-1", vllm_url),),
                                     names=(MODEL, "demo-alias"), running_usage=True)]))
    return make_api_key(ApiKey.Scope.INFERENCE)


def sync_client(gateway_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def replica_client(vllm_url: str) -> openai.OpenAI:
    """The replica itself, asked directly, without the gateway."""
    return openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: Any = {"temperature": 0, "max_tokens": 16}


def test_a_chat_completion_through_the_gateway_is_the_replicas_own_answer(
        gateway_url: str, vllm_url: str, key: str) -> None:
    direct = replica_client(vllm_url).chat.completions.create(
        model=MODEL, messages=QUESTION, **GREEDY)
    answer = sync_client(gateway_url, key).chat.completions.create(
        model=MODEL, messages=QUESTION, **GREEDY)
    assert answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.choices[0].finish_reason == direct.choices[0].finish_reason
    assert answer.usage == direct.usage
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_a_streamed_chat_gives_the_same_answer_as_the_non_streamed_one(
        gateway_url: str, key: str) -> None:
    client = sync_client(gateway_url, key)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, **GREEDY, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage
    assert whole.usage is not None and whole.usage.completion_tokens > 0


def test_an_alias_reaches_the_model(gateway_url: str, key: str) -> None:
    answer = sync_client(gateway_url, key).completions.create(
        model="demo-alias", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert answer.model == MODEL


def test_the_async_client_streams_and_not_the_replicas_own_answer(
        gateway_url: str, vllm_url: str, key: str) -> None:
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=key,
                                    max_retries=0, timeout=120)
        whole = await client.completions.create(model=MODEL, prompt="1, 2, 3,",
                                                max_tokens=8, temperature=0)
        stream = await client.completions.create(model=MODEL, prompt="1, 2, 3,",
                                                 max_tokens=8, temperature=0, stream=True)
        parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        await client.close()
        return whole.choices[0].text, "".join(parts)

    whole, streamed = asyncio.run(run())
    direct = replica_client(vllm_url).completions.create(model=MODEL, prompt="1, 2, 3,",
                                                         max_tokens=8, temperature=0)
    assert whole == streamed == direct.choices[0].text


def test_n_stop_seed_logprobs_and_max_completion_tokens(gateway_url: str, key: str) -> None:
    client = sync_client(gateway_url, key)
    several = client.completions.create(model=MODEL, prompt="Once upon a time", n=2,
                                        max_tokens=5, seed=7, temperature=1.0)
    assert len(several.choices) == 2
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30,
                                        temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text
    with_logprobs = client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                   max_completion_tokens=4, logprobs=True,
                                                   top_logprobs=2, temperature=0)
    content = with_logprobs.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content[0].top_logprobs) == 2
    assert with_logprobs.usage is not None and with_logprobs.usage.completion_tokens <= 4


def test_response_format_json_object_reaches_the_engine(gateway_url: str, vllm_url: str,
                                                        key: str) -> None:
    request: Any = {"model": MODEL, "temperature": 0, "max_tokens": 40,
                    "response_format": {"type": "json_object"},
                    "messages": [{"role": "user", "content": "Give a JSON object with a key "
                                                            "city."}]}
    direct = replica_client(vllm_url).chat.completions.create(**request)
    answer = sync_client(gateway_url, key).chat.completions.create(**request)
    content = answer.choices[0].message.content or ""
    assert content == direct.choices[0].message.content
    # The engine's JSON grammar makes an object begin, whatever the model would say; it
    # may be cut off at max_tokens, so the whole is not parsed.
    assert content.lstrip().startswith("{")


def test_a_prompt_longer_than_the_context_is_a_bad_request(gateway_url: str,
                                                           key: str) -> None:
    with pytest.raises(openai.BadRequestError):
        sync_client(gateway_url, key).completions.create(model=MODEL, prompt="word " * 2000,
                                                         max_tokens=5)


def test_embeddings_on_a_generative_model_are_a_clear_error(gateway_url: str,
                                                            key: str) -> None:
    with pytest.raises(openai.BadRequestError, match="generates text") as error:
        sync_client(gateway_url, key).embeddings.create(model=MODEL, input="hello")
    assert error.value.code == "model_not_embedding"
