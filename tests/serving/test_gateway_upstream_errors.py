"""Upstream error answers that are not in OpenAI's shape reach the client in it, with the
upstream's status: the official `openai` client against the gateway in this process, in
front of a real HTTP server (aiohttp) that answers like an external endpoint would: its
own plain-text `404: Not Found` for a path it does not serve, a long text, vLLM's older
`{"object": "error", ...}` shape."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from aiohttp import web

from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from serving.services import create_api_key
from tests.processes import free_port

pytestmark = pytest.mark.django_db(transaction=True)


async def long_text(request: web.Request) -> web.Response:
    return web.Response(status=400, text="bad request: " + "x" * 20_000)


async def older_vllm_error(request: web.Request) -> web.Response:
    return web.json_response({"object": "error", "message": "max_tokens is too large",
                              "type": "BadRequestError", "param": None, "code": 400},
                             status=400)


@pytest.fixture(scope="module")
def endpoint_url() -> Iterator[str]:
    """An OpenAI-compatible endpoint that serves chat only; /v1/embeddings gets aiohttp's
    own answer for an unknown path."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", older_vllm_error)
    app.router.add_post("/v1/completions", long_text)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def key(endpoint_url: str) -> str:
    # The same endpoint under a second name as an embedding model, which it does not serve.
    routes.publish(build_table([DeploymentRoutes(deployment=deployment, served_model_name="ext",
                                     policy="least-load", max_model_len=2048,
                                     replicas=(RouteReplica("external-1", endpoint_url),),
                                     names=(name,), task=task)
                                for deployment, name, task in (
                                    ("external", "ext", "generate"),
                                    ("external-vectors", "ext-vectors", "embed"))]))
    return create_api_key("app", "inference")[1]


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_plain_text_404_from_an_endpoint_reaches_the_client_in_openais_shape(
        gateway_url: str, endpoint_url: str, key: str) -> None:
    assert httpx.post(f"{endpoint_url}/v1/embeddings").text == "404: Not Found"
    with pytest.raises(openai.NotFoundError) as refused:
        client(gateway_url, key).embeddings.create(model="ext-vectors", input="hello")
    response = refused.value.response
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": {"message": "404: Not Found", "type": "upstream_error",
                                         "param": None, "code": "upstream_error"}}
    assert refused.value.type == "upstream_error" and refused.value.code == "upstream_error"


def test_a_long_upstream_text_is_cut_to_a_readable_message(gateway_url: str,
                                                           key: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(gateway_url, key).completions.create(model="ext", prompt="hi", max_tokens=2)
    error = refused.value.response.json()["error"]
    assert error["type"] == "upstream_error"
    assert error["message"].startswith("bad request: xxx")
    assert len(error["message"]) <= 1001


def test_vllms_older_error_shape_is_wrapped_for_the_client(gateway_url: str,
                                                           key: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(gateway_url, key).chat.completions.create(
            model="ext", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.response.json() == {"error": {
        "message": "max_tokens is too large", "type": "BadRequestError", "param": None,
        "code": 400}}
    assert refused.value.message == "Error code: 400 - max_tokens is too large"
