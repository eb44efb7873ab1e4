"""The gateway's upstream HTTP/1.1 client: keep-alive pools per replica, one write per
request, the C parser uvicorn itself uses (httptools) for responses, and the body handed on
as it arrives (whatever is buffered, in one piece).

It does only what the gateway needs of a replica (vLLM's OpenAI server or any HTTP/1.1
OpenAI-compatible endpoint): a request with a body, a response read whole or as a stream,
chunked or sized bodies, plain HTTP or TLS. A general client (aiohttp, httpx) spends several
times as long per request on features the relay never uses; on two shared cores that time
is what a burst of new streams queues behind.

The package: `connection.py` (one keep-alive connection as an asyncio protocol, and the
Response it hands the caller), `pipe.py` (a stream's chunks to its client as they came),
`pool.py` (the pools, the parsed replica URLs and a request's bytes) and `eager.py` (a
coroutine run at once, as far as it goes without waiting: from a socket's callback, as the
relay sends, or before a task is made for the rest of it).
"""

from __future__ import annotations

from serving.upstream.connection import (
    HIGH_WATER,
    Connection,
    Response,
    Sink,
    UpstreamError,
    UpstreamStalled,
)
from serving.upstream.eager import Unfinished, run_eagerly, start
from serving.upstream.pipe import Pipe
from serving.upstream.pool import (
    CONNECT_TIMEOUT,
    IDLE_PER_HOST,
    ConnectionPool,
    Target,
    request_bytes,
    target,
)

__all__ = ["CONNECT_TIMEOUT", "HIGH_WATER", "IDLE_PER_HOST", "Connection", "ConnectionPool", "Pipe",
           "Response", "Sink", "Target", "Unfinished", "UpstreamError", "UpstreamStalled",
           "request_bytes", "run_eagerly", "start", "target"]
