"""An ASGI middleware for fakes/engine.py (`--middleware bench.any_model.AnyModelName`): a
request naming any model is served as the engine's own model, so one FAKE engine process
stands in for many external deployments, each with its own served model name."""

from __future__ import annotations

import json
from typing import Any

from fakes.engine import read_body

MODEL = "fake"  # the engine's --model


class AnyModelName:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict) and "model" in request:
            request["model"] = MODEL
            body = json.dumps(request).encode()
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
