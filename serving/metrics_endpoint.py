"""/metrics: the control plane's own Prometheus metrics, in the text format."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


async def metrics_application(scope: dict[str, Any],
                              receive: Callable[[], Awaitable[dict[str, Any]]],
                              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    body = generate_latest()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
