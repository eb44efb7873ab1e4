"""The engine guard local replicas load into vLLM (serving/engine_guard.py), around a
stand-in application, over httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import httpx

from serving.engine_guard import EngineGuard

KEY = "engine-key-0123456789"


async def served(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


async def ask(guard: EngineGuard, method: str, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.request(method, path, headers=headers)


async def test_every_path_but_health_and_metrics_needs_the_key() -> None:
    guard = EngineGuard(served, KEY)
    for path in ("/invocations", "/tokenize", "/pooling", "/score", "/v1/models", "/ping",
                 "/health/", "/metricsx"):
        refused = await ask(guard, "POST", path)
        assert (path, refused.status_code, refused.json()) == (
            path, 401, {"error": "Unauthorized"})
    for given in ("Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"):
        refused = await ask(guard, "POST", "/invocations", authorization=given)
        assert (given, refused.status_code) == (given, 401)
    for path in ("/health", "/metrics"):
        assert (await ask(guard, "GET", path)).text == "served"
    for scheme in ("Bearer", "bearer"):
        answered = await ask(guard, "POST", "/invocations", authorization=f"{scheme} {KEY}")
        assert answered.text == "served"
    # A CORS preflight passes, as vLLM lets it.
    assert (await ask(guard, "OPTIONS", "/invocations")).text == "served"


async def test_a_replica_started_without_a_key_serves_only_health_and_metrics() -> None:
    guard = EngineGuard(served, "")
    assert (await ask(guard, "POST", "/invocations",
                      authorization="Bearer ")).status_code == 401
    assert (await ask(guard, "GET", "/health")).text == "served"


async def test_a_websocket_without_the_key_is_closed_before_it_is_accepted() -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    await EngineGuard(served, KEY)(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]
