"""/metrics: the control plane's own Prometheus metrics, in the text format.

With METRICS_TOKEN set, only `Authorization: Bearer <METRICS_TOKEN>` is answered (the
figures name models, deployments and replicas; the scheme is taken in any case, the token
compared in constant time); without it, /metrics is open, for a scraper on the same
private network.

Under `manage.py serve --workers N` (PROMETHEUS_MULTIPROC_DIR set for each worker) the
answer sums every worker's figures, whichever worker it comes from: counters and
histograms added up, gauges as serving/metrics.py says (`livesum`: the live workers'
sum).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from serving.metrics import ASYNCIO_TASKS

Send = Callable[[dict[str, Any]], Awaitable[None]]


def authorized(scope: dict[str, Any]) -> bool:
    token = str(settings.METRICS_TOKEN or "")
    if not token:
        return True
    given = b""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            given = value
    # The scheme in any case (RFC 9110: "bearer" is "Bearer"), the token exact; digests
    # of equal length, so the comparison's time says nothing about the token.
    scheme, _, presented = given.strip().partition(b" ")
    matches = hmac.compare_digest(hashlib.sha256(presented.strip()).digest(),
                                  hashlib.sha256(token.encode()).digest())
    return scheme.lower() == b"bearer" and matches


async def metrics_application(scope: dict[str, Any],
                              receive: Callable[[], Awaitable[dict[str, Any]]],
                              send: Send) -> None:
    if not authorized(scope):
        await answer(send, 401, b"send Authorization: Bearer <METRICS_TOKEN>\n",
                     "text/plain; charset=utf-8",
                     [(b"www-authenticate", b'Bearer realm="metrics"')])
        return
    # Counted here, on the serving loop, where all_tasks() is safe and costs one pass over
    # the loop's task set per scrape (nothing on the request path).
    ASYNCIO_TASKS.set(len(asyncio.all_tasks()))
    await answer(send, 200, exposition(), CONTENT_TYPE_LATEST)


def exposition() -> bytes:
    """This process's metrics, or every worker's when they are kept in files."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        return generate_latest()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return generate_latest(registry)


async def answer(send: Send, status: int, body: bytes, content_type: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
