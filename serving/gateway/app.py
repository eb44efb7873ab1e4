"""The OpenAI-compatible front door: a lean ASGI application for /v1/*.

Per request: authenticate the key (in-memory cache), read and check the body into a Call
(serving/gateway/call.py), charge its rate limits, then `async with self.session(call)`
(serving/session.py: placement, retries, accounting) relay the answer
(serving/gateway/relay.py). No Django middleware and no ORM query on the hot path; what
requests share is built once per event loop (serving/gateway/resources.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from serving.calls import GatewayError, new_id
from serving.gateway.call import (
    PIPE,
    WHEN_LOST,
    WRITE_BODY,
    Call,
    Receive,
    Scope,
    Send,
    Timing,
    build_call,
    header,
)
from serving.gateway.guard import (
    authenticate_caller,
    charge_rate_limits,
    hold_for_key,
    let_go_for_key,
    read_body,
)
from serving.gateway.relay import relay, respond
from serving.gateway.resources import LiveStreams, Resources
from serving.models import REQUEST_ID_MAX_LENGTH
from serving.ratelimit import Limiter, RedisLimiter
from serving.router import Router
from serving.routes import DeploymentRoutes, routes
from serving.session import Session
from serving.usage import UsageWriter

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
             "/v1/embeddings": "embedding"}


class Gateway:
    """The data plane of this process: its router, its per-loop resources, its sessions
    and the ASGI application of /v1/*."""

    def __init__(self) -> None:
        self.router = Router()
        self.streams = LiveStreams()
        # key id -> its requests between authentication and the end of their answer
        self.key_in_flight: dict[int, int] = {}
        self._resources: Resources | None = None

    def resources(self) -> Resources:
        """The running event loop's resources, built on its first request."""
        loop = asyncio.get_running_loop()
        current = self._resources
        if current is None or current.loop is not loop:
            current = self._resources = Resources(loop, self.router, self.streams)
        current.follow_settings()
        current.keep_background()
        return current

    def session(self, call: Call) -> Session:
        """`async with gateway.session(call) as stream`: the call on a replica, every
        account settled when it ends (serving/session.py)."""
        return Session(self.resources(), call)

    # What tests and the shutdown path read of the current loop's resources.
    @property
    def current_resources(self) -> Resources | None:
        """The resources of the loop that served last (none before a first request)."""
        return self._resources

    @property
    def admission(self) -> Any:
        """The priority queue of the loop that served last."""
        return self._resources.admission if self._resources is not None else None

    @property
    def limiter(self) -> Limiter | None:
        """The rate limiter of the loop that served last."""
        return self._resources.limiter if self._resources is not None else None

    @property
    def usage(self) -> UsageWriter | None:
        """The usage writer of the loop that served last."""
        return self._resources.usage if self._resources is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one /v1/* request."""
        resources = self.resources()  # the load watcher (which follows the table) runs
        request_id = header(scope, b"x-request-id") or ""
        if (not request_id or len(request_id) > REQUEST_ID_MAX_LENGTH
                or not request_id.isprintable()):
            request_id = new_id()  # absent, or not fit to log and pass on
        base_headers = [(b"x-request-id", request_id.encode())]
        try:
            path, method = scope["path"], scope["method"]
            if path == "/v1/models" and method == "GET":
                await self.list_models(resources, scope, send, base_headers)
            elif path.startswith("/v1/models/"):
                if method != "GET":
                    raise GatewayError(405, f"{path} takes GET", code="method_not_allowed")
                await self.retrieve_model(resources, scope, send, base_headers)
            elif path in ENDPOINTS:
                if method != "POST":
                    raise GatewayError(405, f"{path} takes POST", code="method_not_allowed")
                await self.proxy(resources, scope, receive, send, request_id, base_headers)
            else:
                raise GatewayError(404, f"unknown path {path}", code="not_found")
        except GatewayError as error:
            await respond(send, error.status, error.body(), base_headers + error.headers)

    async def list_models(self, resources: Resources, scope: Scope, send: Send,
                          headers: list[tuple[bytes, bytes]]) -> None:
        """The model names the key may use."""
        key = await authenticate_caller(resources, scope)
        created = int(time.time())
        data = [model_object(name, found, created)
                for name, found in sorted(routes.table.pools.items())
                if key.allows(name, found.deployment, found.served_model_name)]
        await respond(send, 200, orjson.dumps({"object": "list", "data": data}), headers)

    async def retrieve_model(self, resources: Resources, scope: Scope, send: Send,
                             headers: list[tuple[bytes, bytes]]) -> None:
        """One model, as in the list. A model the key may not use gets the same 404 as
        one that does not exist: a key learns nothing about models beyond its own."""
        key = await authenticate_caller(resources, scope)
        name = scope["path"].removeprefix("/v1/models/")
        found = routes.table.routes_for(name)
        if found is None or not key.allows(name, found.deployment, found.served_model_name):
            raise GatewayError(404, f"The model `{name[:200]}` does not exist.",
                               kind="not_found_error", param="model", code="model_not_found")
        await respond(send, 200, orjson.dumps(model_object(name, found, int(time.time()))),
                      headers)

    async def proxy(self, resources: Resources, scope: Scope, receive: Receive, send: Send,
                    request_id: str, headers: list[tuple[bytes, bytes]]) -> None:
        """A completion, chat or embedding request, relayed to a replica."""
        key = await authenticate_caller(resources, scope)
        hold_for_key(self.key_in_flight, key)
        try:
            timing = Timing()
            raw = await read_body(scope, receive)
            call = build_call(scope, raw, ENDPOINTS[scope["path"]], key, request_id, timing)
            call.receive = receive
            extensions = scope.get("extensions") or {}
            call.write_body = extensions.get(WRITE_BODY)
            call.when_lost = extensions.get(WHEN_LOST)
            call.pipe_to = extensions.get(PIPE)
            if not isinstance(resources.limiter, RedisLimiter):
                await let_answers_go_first()
            headers = headers + await charge_rate_limits(resources, call)
            try:
                async with Session(resources, call) as stream:
                    if call.ticket is not None:
                        headers = [*headers, *call.ticket.headers()]
                    await relay(resources, call, stream, send, headers)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not call.client_left or (task is not None and task.cancelling()):
                    raise
                # The client went while the call waited in the queue: recorded as 499
                # there; nobody is left to answer (uvicorn would log it as an error).
        finally:
            let_go_for_key(self.key_in_flight, key)


async def let_answers_go_first() -> None:
    """Wait for the event loop's next turn, once, between a request's first checks (its
    key, its body) and its rate limits and placement: where the limits are kept in
    Redis, the wait for their verdict splits a request's work there already.

    Each turn the loop runs the steps that became ready during the last one, in order,
    then reads its sockets. A burst of new requests (a client opening 128 streams at
    once sends dozens into one turn) would otherwise run to their replicas in one long
    turn, and the answers that began meanwhile wait behind it: their heads, which open
    the pipe their tokens go through, then their first tokens. Split in two, a burst's
    first checks run in one turn and the rest in the next, with the answers that became
    ready between them (docs/benchmarks.md: the leg from the engine's first token to the
    client)."""
    await asyncio.sleep(0)


def model_object(name: str, found: DeploymentRoutes, created: int) -> dict[str, Any]:
    """A routable model name in OpenAI's model shape, with what a client may plan by."""
    return {"id": name, "object": "model", "created": created, "owned_by": "fleetplane",
            "root": found.served_model_name, "max_model_len": found.max_model_len,
            "ready_replicas": len(found.replicas)}
