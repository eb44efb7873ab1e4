"""An ASGI middleware that local replicas load into vLLM (`--middleware
serving.engine_guard.EngineGuard`): every path but /health and /metrics needs the
deployment's engine key.

vLLM's own `--api-key` check guards only /v1, /v2, /inference and /cohere. Its other
routes answer anyone who can reach the port: SageMaker's POST /invocations runs a chat
completion, and /tokenize, /detokenize, /pooling, /classify, /score and /rerank do model
work, all without keys, limits, budgets or usage. This guard refuses them without
`Authorization: Bearer <VLLM_API_KEY>` exactly as vLLM refuses /v1/*: 401 with
{"error": "Unauthorized"}. OPTIONS (CORS preflight) passes, as it does in vLLM.

Standard library only, and no Django: it runs inside the replica's interpreter, which
imports it through the PYTHONPATH the local backend gives the replica.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
# Liveness (the backend's health checks, Kubernetes-style probes) and the collector's
# scrape; neither runs the model.
OPEN_PATHS = frozenset({"/health", "/metrics"})
UNAUTHORIZED = b'{"error": "Unauthorized"}'


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class EngineGuard:
    """Refuses every HTTP request and WebSocket outside OPEN_PATHS without the engine key
    (read from VLLM_API_KEY when the server starts). With no key set nothing but
    OPEN_PATHS is served: a replica without its key is closed, not open."""

    def __init__(self, app: App, key: str | None = None) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "") if key is None else key
        self._key_digest = _digest(key.encode()) if key else b""

    def authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not self._key_digest:
            return False
        # Digests of equal length: the comparison's time says nothing about the key.
        return hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        root = scope.get("root_path", "")
        path = scope.get("path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            # Policy violation, before the handshake is accepted.
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})
