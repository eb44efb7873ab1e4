"""The OpenAI-compatible gateway: a lean ASGI application for /v1/*.

Per request: authenticate the key (in-memory cache), read and check the body, pick the
deployment's pool from the route table, let the router pick a replica, relay the answer.
No Django middleware and no ORM query on the hot path; one pooled HTTP client; the
upstream stream is relayed as it arrives, whatever bytes are buffered in one write.

A failure before the first byte is retried on another replica; after it, the client gets a
final SSE error event. A client that disconnects cancels its upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from django.conf import settings

from serving import figures, metrics  # figures: the gateway figures hook
from serving.admission import Admission, Refused, Ticket, retry_after_header
from serving.calls import (
    GatewayError,
    check_parameters,
    estimate_prompt_tokens,
    prompt_prefix,
    reserved_completion_tokens,
    well_formed,
)
from serving.engine_metrics import requests_in_system
from serving.keys import (
    KeyInfo,
    KeysUnavailable,
    authenticate,
    authenticate_hash,
    follow_key_changes,
)
from serving.models import REQUEST_ID_MAX_LENGTH
from serving.priority import DEFAULT_CLASS, PriorityClass, classes
from serving.ratelimit import (
    Limit,
    MemoryLimiter,
    RedisLimiter,
    key_limits,
    token_charges,
)
from serving.router import Router
from serving.routes import Pool, RouteReplica, replica_auth, routes
from serving.upstream import Pool as ConnectionPool
from serving.upstream import Response, UpstreamError
from serving.usage import Usage, UsageWriter

logger = logging.getLogger("serving.gateway")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
             "/v1/embeddings": "embedding"}
MAX_ATTEMPTS = 3
RETRY_STATUSES = {500, 502, 503, 504}


@dataclass
class Timing:
    arrived: float = field(default_factory=time.perf_counter)
    sent: float = 0.0
    first_byte: float = 0.0
    last_chunk: float = 0.0
    gaps: float = 0.0
    chunks: int = 0
    ticket: Ticket | None = None  # the admission slot held, released when the answer ends
    events: int = 0  # SSE data events relayed (the completion's size when no usage came)
    reserved: int = 0  # completion tokens charged to the token budget at admission
    answered: bool = False  # a replica answered (else admission's charge is given back)


class Gateway:
    def __init__(self) -> None:
        self.router = Router()
        self.client: ConnectionPool | None = None
        self.usage: UsageWriter | None = None
        self.background: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.admission = Admission()
        self.limiter: MemoryLimiter | RedisLimiter = MemoryLimiter()
        self.limiter_url: str | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        # key id -> its requests between authentication and the end of their answer
        self.key_in_flight: dict[int, int] = {}
        # key hash -> the relays of its running streams; cut off when the key is revoked
        self.streams: dict[str, set[asyncio.Task[None]]] = {}
        self.cut_off: set[asyncio.Task[None]] = set()

    # --- plumbing --------------------------------------------------------------------

    def http(self) -> ConnectionPool:
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            # First use, or a new event loop (tests run several): connections, the usage
            # writer and the watcher belong to the loop they were made in.
            self.loop = loop
            self.client = ConnectionPool()
            self.usage = UsageWriter()
            self.background = None
            self.admission = Admission()
            self.limiter_url = None
            # --- gateway figures (serving/figures.py): published for the controllers ---
            self.spawn(figures.publish_forever())
            # --- end of gateway figures ---
        if self.limiter_url != (settings.REDIS_URL or ""):
            # Budgets are shared through Redis when it is configured (read here, so a
            # changed setting takes effect), else kept in this process.
            self.limiter_url = settings.REDIS_URL or ""
            self.limiter = (RedisLimiter(self.limiter_url) if self.limiter_url
                            else MemoryLimiter())
        if self.background is None or self.background.done():
            self.background = loop.create_task(self.watch_load())
        assert self.client is not None
        return self.client

    async def watch_load(self) -> None:
        """Scrape each routed replica's queue (vLLM's running + waiting) for least-load
        routing, and follow the route table in Redis when the controller runs elsewhere."""
        redis_connection: Any = None
        while True:
            try:
                if settings.REDIS_URL:
                    if redis_connection is None:
                        import redis.asyncio as redis

                        # One pooled connection for the life of the watcher.
                        redis_connection = redis.Redis.from_url(str(settings.REDIS_URL))
                    await follow_key_changes(redis_connection)
                    if not routes.publishes_locally:
                        await self.load_routes_from_redis(redis_connection)
                await self.scrape_load()
                self.refresh_capacity()
            except Exception:
                logger.exception("load watcher failed; trying again")
            try:
                await self.end_streams_of_revoked_keys()
            except Exception:
                logger.exception("could not check the keys of running streams")
            await asyncio.sleep(settings.GATEWAY_LOAD_SCRAPE_SECONDS)

    async def end_streams_of_revoked_keys(self) -> None:
        """Cut off the running streams of keys revoked or expired since they began (seen
        through the key cache: at once in this process, within GATEWAY_LOAD_SCRAPE_SECONDS
        in others with Redis, within KEY_CACHE_SECONDS without)."""
        for key_hash in list(self.streams):
            if await authenticate_hash(key_hash) is None:
                for pump in self.streams.pop(key_hash, ()):
                    if not pump.done():
                        self.cut_off.add(pump)
                        pump.cancel()

    def refresh_capacity(self) -> None:
        """Replicas came or went: waiting requests take the new slots."""
        now = time.monotonic()
        for pool in {p.deployment: p for p in routes.table.pools.values()}.values():
            for lane, replicas in pool.lanes().items():
                # Healthy replicas only, as at admission: no slots on one sitting out.
                healthy = sum(1 for r in replicas
                              if self.router.state(r.name).unhealthy_until <= now)
                self.admission.set_capacity(f"{pool.deployment}|{lane}",
                                            healthy * pool.replica_concurrency)
            metrics.child(metrics.QUEUE_ESTIMATE, pool.deployment).set(
                round(self.admission.estimated_wait(pool.deployment), 3))

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def load_routes_from_redis(connection: Any) -> None:
        from serving.routes import REDIS_KEY

        text = await connection.get(REDIS_KEY)
        if text:
            routes.load_json(text.decode() if isinstance(text, bytes) else str(text))

    async def scrape_load(self) -> None:
        table = routes.table
        replicas = {r.name: r for pool in table.pools.values() for r in pool.replicas}
        self.router.forget_missing(set(replicas))
        if not replicas:
            return
        client = self.http()

        async def one(replica: RouteReplica) -> None:
            try:
                async with asyncio.timeout(2):
                    text = await client.get_text(replica.url, "/metrics",
                                                 replica_auth(replica))
            except (UpstreamError, TimeoutError):
                return
            state = self.router.state(replica.name)
            state.scraped = int(requests_in_system(text) or 0)
            if state.failures:
                # Active health: a replica that answers again is taken back in.
                self.router.succeeded(replica.name)

        await asyncio.gather(*(one(r) for r in replicas.values()))

    # --- ASGI ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.http()  # the load watcher (which also follows the route table) runs
        request_id = header(scope, b"x-request-id") or ""
        if (not request_id or len(request_id) > REQUEST_ID_MAX_LENGTH
                or not request_id.isprintable()):
            request_id = uuid.uuid4().hex  # absent, or not fit to log and pass on
        base_headers = [(b"x-request-id", request_id.encode())]
        try:
            path, method = scope["path"], scope["method"]
            if path == "/v1/models" and method == "GET":
                await self.list_models(scope, send, base_headers)
            elif path.startswith("/v1/models/"):
                if method != "GET":
                    raise GatewayError(405, f"{path} takes GET", code="method_not_allowed")
                await self.retrieve_model(scope, send, path.removeprefix("/v1/models/"),
                                          base_headers)
            elif path in ENDPOINTS:
                if method != "POST":
                    raise GatewayError(405, f"{path} takes POST", code="method_not_allowed")
                await self.proxy(scope, receive, send, ENDPOINTS[path], request_id,
                                 base_headers)
            else:
                raise GatewayError(404, f"unknown path {path}", code="not_found")
        except GatewayError as error:
            await respond(send, error.status, error.body(), base_headers + error.headers)

    async def authenticate(self, scope: Scope) -> KeyInfo:
        """The caller's key. Unknown, revoked, expired, forged and truncated keys all get
        the same 401. Failed attempts are counted per client address: beyond
        GATEWAY_AUTH_FAILURES_PER_MINUTE, further failed attempts get 429. A request with
        a valid key is never refused by that count, so one client guessing keys behind a
        shared address (an ingress, a NAT) cannot lock the others out."""
        try:
            return await self.check_key(scope)
        except GatewayError as refused:
            if refused.status != 401 or not settings.GATEWAY_AUTH_FAILURES_PER_MINUTE:
                raise
            address = (scope.get("client") or ("-", 0))[0]
            failures = Limit("requests", f"authfail:{address}",
                             settings.GATEWAY_AUTH_FAILURES_PER_MINUTE, 1)
            try:
                verdict = await self.limiter.admit([failures])  # counts this attempt
            except Exception:  # no count to go by: the attempt is answered as it is
                logger.exception("could not count a failed authentication attempt")
                raise refused from None
            if verdict.allowed:
                raise
        metrics.child(metrics.REFUSED, "-", "auth_failures").inc()
        raise GatewayError(429, "too many failed authentication attempts from this address",
                           kind="rate_limit_error", code="too_many_auth_failures",
                           headers=[retry_after_header(verdict.retry_after)])

    async def check_key(self, scope: Scope) -> KeyInfo:
        value = header(scope, b"authorization")
        if not value:
            raise GatewayError(401, "missing API key: send Authorization: Bearer <key>",
                               kind="authentication_error", code="missing_api_key")
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(401, "use Authorization: Bearer <key>",
                               kind="authentication_error", code="invalid_api_key")
        key = key.strip()
        if not well_formed(key):  # no key of ours looks like this: no lookup to make
            info = None
        else:
            try:
                info = await authenticate(key)
            except KeysUnavailable:
                logger.exception("could not check an API key")
                raise GatewayError(503, "API keys cannot be checked now (the database is "
                                        "unreachable); try again shortly",
                                   kind="service_unavailable", code="keys_unavailable",
                                   headers=[(b"retry-after", b"2")]) from None
        if info is None:
            raise GatewayError(401, "invalid or revoked API key", kind="authentication_error",
                               code="invalid_api_key")
        return info

    async def list_models(self, scope: Scope, send: Send,
                          headers: list[tuple[bytes, bytes]]) -> None:
        key = await self.authenticate(scope)
        created = int(time.time())
        data = [model_object(name, pool, created)
                for name, pool in sorted(routes.table.pools.items())
                if key.allows(name, pool.deployment, pool.served_model_name)]
        await respond(send, 200, orjson.dumps({"object": "list", "data": data}), headers)

    async def retrieve_model(self, scope: Scope, send: Send, name: str,
                             headers: list[tuple[bytes, bytes]]) -> None:
        """One model, as in the list. A model the key may not use gets the same 404 as
        one that does not exist: a key learns nothing about models beyond its own."""
        key = await self.authenticate(scope)
        pool = routes.table.pool_for(name)
        if pool is None or not key.allows(name, pool.deployment, pool.served_model_name):
            raise GatewayError(404, f"The model `{name[:200]}` does not exist.",
                               kind="not_found_error", param="model", code="model_not_found")
        await respond(send, 200, orjson.dumps(model_object(name, pool, int(time.time()))),
                      headers)

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = settings.GATEWAY_MAX_BODY_BYTES
        declared = header(scope, b"content-length")
        # isdigit() alone takes "¹" (a latin-1 header byte) for a digit int() refuses.
        if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"request body over the limit of {limit} bytes",
                               code="request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise GatewayError(413, f"request body over the limit of {limit} bytes",
                                   code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def proxy(self, scope: Scope, receive: Receive, send: Send, kind: str,
                    request_id: str, headers: list[tuple[bytes, bytes]]) -> None:
        key = await self.authenticate(scope)
        held = self.key_in_flight.get(key.key_id, 0)
        most = settings.GATEWAY_KEY_MAX_IN_FLIGHT
        if most and held >= most:
            metrics.child(metrics.REFUSED, "-", "key_in_flight").inc()
            raise GatewayError(429, f"this API key already has {held} requests in flight "
                                    f"(at most {most}); wait for one to finish",
                               kind="rate_limit_error", code="too_many_requests_in_flight",
                               headers=[(b"retry-after", b"1")])
        self.key_in_flight[key.key_id] = held + 1
        try:
            await self.call(scope, receive, send, kind, request_id, headers, key)
        finally:
            left = self.key_in_flight.get(key.key_id, 1) - 1
            if left > 0:
                self.key_in_flight[key.key_id] = left
            else:
                self.key_in_flight.pop(key.key_id, None)

    async def call(self, scope: Scope, receive: Receive, send: Send, kind: str,
                   request_id: str, headers: list[tuple[bytes, bytes]], key: KeyInfo
                   ) -> None:
        timing = Timing()
        raw = await self.read_body(scope, receive)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(400, f"malformed JSON body: {exc}", code="invalid_json") \
                from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
        check_parameters(body, kind)
        model = body["model"]
        pool = routes.table.pool_for(model)
        if pool is None:
            raise GatewayError(404, f"The model `{model}` does not exist.",
                               kind="not_found_error", param="model", code="model_not_found")
        if not key.allows(model, pool.deployment, pool.served_model_name):
            raise GatewayError(403, f"this API key may not use the model `{model}`",
                               kind="permission_error", param="model",
                               code="model_not_allowed")
        priority = self.priority_of(scope, key)
        prompt_tokens = estimate_prompt_tokens(body, kind)
        timing.reserved = reserved_completion_tokens(body, kind, pool.max_model_len,
                                                     prompt_tokens)
        limits = key_limits(key, prompt_tokens, timing.reserved)
        if limits:
            try:
                verdict = await self.limiter.admit(limits)
            except Exception:
                logger.exception("could not check the rate limits")
                raise GatewayError(503, "the rate limits cannot be checked now (their store "
                                        "is unreachable); try again shortly",
                                   kind="service_unavailable", code="limits_unavailable",
                                   headers=[(b"retry-after", b"1")]) from None
            if not verdict.allowed:
                metrics.child(metrics.REFUSED, pool.deployment, "rate_limit").inc()
                raise GatewayError(429, "rate limit reached for this API key or its team; "
                                        "see the x-ratelimit-* headers",
                                   kind="rate_limit_error", code="rate_limit_exceeded",
                                   headers=verdict.headers())
            headers = headers + verdict.headers()
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rewrite = model != pool.served_model_name or (stream and not wants_usage)
        if pool.priority_scheduling:  # vLLM's scheduler orders by it (lower first)
            body["priority"] = priority.level
            rewrite = True
        if rewrite:
            body["model"] = pool.served_model_name
            if stream and not wants_usage:
                # Usage is needed for the records; the event is taken out again below.
                body["stream_options"] = {**(body.get("stream_options") or {}),
                                          "include_usage": True}
            raw = orjson.dumps(body)
        session = header(scope, b"x-session-id") or str(body.get("user") or "") or None
        prefix = prompt_prefix(body, kind)
        try:
            await self.relay(send, receive, key, pool, model, scope["path"], raw, stream,
                             wants_usage, session, prefix, request_id, headers, timing,
                             priority=priority, prompt_tokens=prompt_tokens)
        except BaseException:
            if limits and not timing.answered:  # no replica answered: no budget used
                self.spawn(self.refund(limits))
            raise

    @staticmethod
    def priority_of(scope: Scope, key: KeyInfo) -> PriorityClass:
        """The key's class, or a lower one asked for with X-Priority."""
        known = classes()
        own = known.get(key.priority) or known[DEFAULT_CLASS]
        asked = header(scope, b"x-priority")
        if not asked:
            return own
        wanted = known.get(asked.strip().lower())
        if wanted is None:
            raise GatewayError(400, f"unknown priority class {asked.strip()[:40]!r}: one of "
                                    f"{', '.join(known)}", param="x-priority",
                               code="invalid_priority")
        if wanted.level < own.level:
            raise GatewayError(403, f"this API key may not use the priority class "
                                    f"{wanted.name!r} (its highest is {own.name!r})",
                               kind="permission_error", param="x-priority",
                               code="priority_not_allowed")
        return wanted

    async def open_upstream(self, pool: Pool, model: str, path: str, raw: bytes,
                            session: str | None, prefix: str | None, request_id: str,
                            timing: Timing, *, key: KeyInfo | None, stream: bool,
                            user: str = "", priority: PriorityClass | None = None,
                            prompt_tokens: int = 0, receive: Receive | None = None
                            ) -> tuple[RouteReplica, Response]:
        """Send the request to a replica the router picks, retrying on another one when it
        fails before answering; the chosen replica's in-flight count includes it. When
        every replica of its context pool is full, wait in the priority queue first: the
        slot taken is in `timing.ticket`, and the caller gives it back with `release`."""
        client = self.http()
        if not pool.replicas and pool.wakes:
            pool = await self.wait_for_capacity(pool, model)
        lane = pool.lane_for(prompt_tokens)
        if lane != "all":
            pool = replace(pool, replicas=pool.lanes()[lane])
        healthy = len(self.router.healthy(pool))
        if healthy:
            priority = priority or classes()[DEFAULT_CLASS]
            try:
                owner = f"key:{key.key_id}" if key is not None else f"user:{user}"
                timing.ticket = await self.admit(
                    f"{pool.deployment}|{lane}", healthy * pool.replica_concurrency, priority,
                    receive, owner)
            except asyncio.CancelledError:
                # The client left while waiting; counted like a client that leaves mid-answer.
                self.record(key, model, pool, "", 499, stream, None, timing, request_id,
                            user=user)
                raise
            except Refused as exc:
                metrics.child(metrics.REFUSED, pool.deployment, exc.code).inc()
                self.record(key, model, pool, "", exc.status, stream, None, timing,
                            request_id, user=user)
                raise GatewayError(exc.status, exc.message, kind="rate_limit_error"
                                   if exc.status == 429 else "service_unavailable",
                                   code=exc.code,
                                   headers=[retry_after_header(exc.retry_after)]) from None
            if timing.ticket.position:
                metrics.child(metrics.QUEUE_WAIT, pool.deployment, priority.name).observe(
                    timing.ticket.waited)
        try:
            return await self.place(client, pool, model, path, raw, session, prefix,
                                    request_id, timing, key=key, stream=stream, user=user)
        except BaseException:
            self.release(timing, finished=False)
            raise

    async def admit(self, lane: str, capacity: int, priority: PriorityClass,
                    receive: Receive | None, owner: str | None = None) -> Ticket:
        """A slot from the priority queue. With `receive` (an HTTP request), a client that
        disconnects while it waits leaves the queue at once: the server does not cancel the
        request's task, it only says so through `receive`."""
        ticket = self.admission.try_acquire(lane, capacity, priority)
        if ticket is not None:
            return ticket
        acquiring = asyncio.ensure_future(self.admission.acquire(lane, capacity, priority,
                                                                 owner))
        if receive is None:
            return await acquiring
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({acquiring, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquiring.cancel()
            raise
        finally:
            watcher.cancel()
        if not acquiring.done():  # the client went away first
            acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Refused):
                await acquiring
            raise asyncio.CancelledError
        return acquiring.result()

    def release(self, timing: Timing, *, finished: bool = True) -> None:
        """Give back the admission slot of a request that has ended (once)."""
        ticket, timing.ticket = timing.ticket, None
        if ticket is not None:
            self.admission.release(ticket.lane, finished=finished)

    async def place(self, client: ConnectionPool, pool: Pool, model: str, path: str,
                    raw: bytes, session: str | None, prefix: str | None, request_id: str,
                    timing: Timing, *, key: KeyInfo | None, stream: bool, user: str
                    ) -> tuple[RouteReplica, Response]:
        tried: list[str] = []
        base_headers = (("Content-Type", "application/json"), ("X-Request-Id", request_id))
        response: Response | None = None
        replica: RouteReplica | None = None
        last_error = ""
        for attempt in range(MAX_ATTEMPTS):
            replica = self.router.choose(pool, session=session, prefix=prefix, exclude=tried)
            if replica is None:
                break
            if attempt:
                metrics.child(metrics.RETRIES, model).inc()
            tried.append(replica.name)
            state = self.router.state(replica.name)
            state.in_flight += 1
            timing.sent = time.perf_counter()
            # Replicas demand their deployment's engine key (an external endpoint its own).
            upstream_headers = (*base_headers, *replica_auth(replica))
            try:
                response = await client.request("POST", replica.url, path, raw,
                                                upstream_headers)
            except UpstreamError as exc:
                state.in_flight -= 1
                self.router.failed(replica.name)
                metrics.child(metrics.UPSTREAM_ERRORS, model, pool.deployment).inc()
                last_error = f"{replica.name}: {exc}"
                response = None
                continue
            except asyncio.CancelledError:  # the caller went away before the answer began
                state.in_flight -= 1
                raise
            if response.status in RETRY_STATUSES and attempt + 1 < MAX_ATTEMPTS:
                state.in_flight -= 1
                self.router.failed(replica.name)
                metrics.child(metrics.UPSTREAM_ERRORS, model, pool.deployment).inc()
                last_error = f"{replica.name}: HTTP {response.status}"
                response.release()
                response = None
                continue
            break
        if response is None or replica is None:
            message = (f"no ready replica for model `{model}`" if not tried else
                       f"every replica failed before answering ({last_error})")
            self.record(key, model, pool, "", 503, stream, None, timing, request_id, user=user)
            raise GatewayError(503, message, kind="service_unavailable", code="no_replica",
                               headers=[(b"retry-after", b"2")])
        timing.answered = True
        return replica, response

    async def wait_for_capacity(self, pool: Pool, model: str) -> Pool:
        """A deployment scaled to zero: wait (up to GATEWAY_COLD_START_WAIT_SECONDS) while
        the autoscaler, told by the demand count, brings a replica up."""
        from serving.demand import demand

        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.GATEWAY_COLD_START_WAIT_SECONDS
        connection: Any = None
        published = 0.0
        demand.add(pool.deployment, 1)
        try:
            while True:
                current = routes.table.pool_for(model) or pool
                if current.replicas or not current.wakes:
                    return current
                now = loop.time()
                if now >= deadline:
                    raise GatewayError(
                        503, f"no replica of `{model}` came up within "
                             f"{settings.GATEWAY_COLD_START_WAIT_SECONDS:g} s",
                        kind="service_unavailable", code="no_replica",
                        headers=[(b"retry-after", b"10")])
                if settings.REDIS_URL and now - published >= 1.0:
                    if connection is None:
                        import redis.asyncio as redis

                        connection = redis.Redis.from_url(str(settings.REDIS_URL))
                    await demand.publish(connection, pool.deployment)
                    published = now
                await asyncio.sleep(0.05)
        finally:
            demand.add(pool.deployment, -1)
            if connection is not None:
                await demand.publish(connection, pool.deployment)
                await connection.aclose()

    async def relay(self, send: Send, receive: Receive, key: KeyInfo, pool: Pool, model: str,
                    path: str, raw: bytes, stream: bool, wants_usage: bool,
                    session: str | None,
                    prefix: str | None, request_id: str, headers: list[tuple[bytes, bytes]],
                    timing: Timing, *, priority: PriorityClass,
                    prompt_tokens: int) -> None:
        replica, response = await self.open_upstream(pool, model, path, raw, session, prefix,
                                                      request_id, timing, key=key,
                                                      stream=stream, priority=priority,
                                                      prompt_tokens=prompt_tokens,
                                                      receive=receive)
        if timing.ticket is not None:
            headers = [*headers, *timing.ticket.headers()]
        state = self.router.state(replica.name)
        metrics.child(metrics.IN_FLIGHT, model, pool.deployment).inc()
        status = response.status
        usage: dict[str, Any] | None = None
        try:
            content_type = response.headers.get("content-type", "application/json")
            out_headers = [*headers, (b"content-type", content_type.encode())]
            if stream and status == 200:
                out_headers.append((b"cache-control", b"no-cache"))
                usage, completed = await self.relay_stream(
                    send, receive, response, out_headers, wants_usage, timing, model, pool,
                    replica, key.key_hash)
            else:
                try:
                    payload = await read_unless_gone(response, receive,
                                                     settings.GATEWAY_MAX_RESPONSE_BYTES)
                except ResponseTooLarge as exc:
                    response.close()
                    status = 502
                    self.record(key, model, pool, replica.name, status, stream, None, timing,
                                request_id)
                    raise GatewayError(502, str(exc), kind="upstream_error",
                                       code="response_too_large") from None
                except UpstreamError as exc:
                    self.router.failed(replica.name)
                    metrics.child(metrics.UPSTREAM_ERRORS, model, pool.deployment).inc()
                    status = 502
                    self.record(key, model, pool, replica.name, status, stream, None, timing,
                                request_id)
                    raise GatewayError(502, f"the replica failed while answering ({exc})",
                                       kind="upstream_error", code="upstream_error") from None
                if payload is None:  # the client went away; closing tells the engine
                    response.close()
                    status = 499
                    self.record(key, model, pool, replica.name, status, stream, None, timing,
                                request_id)
                    return
                timing.first_byte = timing.last_chunk = time.perf_counter()
                if not 200 <= status < 300:
                    # Clients parse errors in OpenAI's shape; an engine or an external
                    # endpoint may answer plain text ("404: Not Found") or another JSON.
                    payload = upstream_error_body(status, payload)
                    out_headers = [*headers, (b"content-type", b"application/json")]
                await respond(send, status, payload, out_headers)
                if status == 200:
                    with contextlib.suppress(orjson.JSONDecodeError):
                        parsed = orjson.loads(payload)
                        usage = parsed.get("usage") if isinstance(parsed, dict) else None
                completed = True
            if completed:
                self.router.succeeded(replica.name)
        finally:
            response.release()
            state.in_flight -= 1
            self.release(timing)
            metrics.child(metrics.IN_FLIGHT, model, pool.deployment).dec()
            if key.tpm or key.team_tpm:
                # What was used, less what admission charged (the prompt's estimate and the
                # reserved completion), once known: more is charged, less given back.
                # A stream the client left has no usage: its relayed events count instead.
                # A non-streamed answer the client left, or one cut off, has no count
                # either: what it may have made, its reservation, stays charged.
                completion = (usage or {}).get("completion_tokens")
                prompt = (usage or {}).get("prompt_tokens")
                if not isinstance(completion, int):
                    completion = (timing.events if stream else
                                  timing.reserved if status in (499, 502) else 0)
                charges = token_charges(
                    key, completion, prompt if isinstance(prompt, int) else None,
                    prompt_tokens, timing.reserved)
                if charges:
                    self.spawn(self.charge(charges))
        self.record(key, model, pool, replica.name, status, stream, usage, timing, request_id)

    async def charge(self, charges: list[Limit]) -> None:
        try:
            await self.limiter.charge(charges)
        except Exception:
            logger.exception("could not charge tokens to the rate limits")

    async def refund(self, limits: list[Limit]) -> None:
        try:
            await self.limiter.refund(limits)
        except Exception:
            logger.exception("could not give back a refused request's budget")

    async def relay_stream(self, send: Send, receive: Receive,
                           response: Response,
                           headers: list[tuple[bytes, bytes]], wants_usage: bool,
                           timing: Timing, model: str, pool: Pool,
                           replica: RouteReplica, key_hash: str = ""
                           ) -> tuple[dict[str, Any] | None, bool]:
        """Relay a stream; returns the usage it carried and whether it ended cleanly."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        found: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        # Two tasks per stream, none per chunk: one relays, one waits for the client to go.
        pump = loop.create_task(self.pump(send, response, wants_usage, timing, found))
        watcher = loop.create_task(wait_for_disconnect(receive))
        mine = self.streams.setdefault(key_hash, set()) if key_hash else None
        if mine is not None:
            mine.add(pump)  # cut off if the key is revoked meanwhile
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pump.cancel()
            response.close()
            raise
        finally:
            watcher.cancel()
            if mine is not None:
                mine.discard(pump)
                if not mine and self.streams.get(key_hash) is mine:
                    del self.streams[key_hash]
        if pump in self.cut_off:  # the key was revoked or expired mid-stream
            self.cut_off.discard(pump)
            response.close()
            notice = {"error": {"message": "the API key was revoked or has expired; the "
                                           "answer was cut off",
                                "type": "authentication_error", "code": "api_key_revoked"}}
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body",
                            "body": b"data: " + orjson.dumps(notice) + b"\n\n",
                            "more_body": False})
            return found.get("usage"), False
        if not pump.done():  # the client went away: the engine sees it and frees its cache
            pump.cancel()
            response.close()
            return found.get("usage"), True
        error = pump.exception()
        if isinstance(error, UpstreamError):
            self.router.failed(replica.name)
            metrics.child(metrics.UPSTREAM_ERRORS, model, pool.deployment).inc()
            event = {"error": {"message": f"the replica failed mid-stream ({error})",
                               "type": "upstream_error", "code": 502}}
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body",
                            "body": b"data: " + orjson.dumps(event) + b"\n\n",
                            "more_body": False})
            return found.get("usage"), False
        elif error is not None:
            raise error
        return found.get("usage"), True

    @staticmethod
    async def pump(send: Send, response: Response, wants_usage: bool,
                   timing: Timing, found: dict[str, Any]) -> None:
        """Relay the upstream as it arrives: whatever bytes are buffered, in one write."""
        pending = b""
        while True:
            chunk = await response.readany()
            if not chunk:
                break
            now = time.perf_counter()
            if timing.chunks == 0:
                timing.first_byte = now
            else:
                timing.gaps += now - timing.last_chunk
            timing.last_chunk = now
            timing.chunks += 1
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                pending = data
                continue
            if cut + 2 == len(data):
                complete, pending = data, b""
            else:
                complete, pending = data[: cut + 2], data[cut + 2:]
            timing.events += complete.count(b"data: {")
            if b'"usage"' in complete and b'"choices":[]' in complete:
                complete, found["usage"] = take_usage(complete, keep=wants_usage)
            if complete:
                await send({"type": "http.response.body", "body": complete, "more_body": True})
        await send({"type": "http.response.body", "body": pending, "more_body": False})

    def record(self, key: KeyInfo | None, model: str, pool: Pool, replica: str, status: int,
               stream: bool, usage: dict[str, Any] | None, timing: Timing,
               request_id: str, *, user: str = "") -> None:
        end = timing.last_chunk or time.perf_counter()
        metrics.child(metrics.REQUESTS, model, pool.deployment, str(status)).inc()
        metrics.E2E.labels(model).observe(end - timing.arrived)
        ttft = timing.first_byte - timing.arrived if timing.first_byte else None
        if ttft is not None:
            metrics.child(metrics.TTFT, model).observe(ttft)
        itl = timing.gaps / (timing.chunks - 1) if timing.chunks > 1 else None
        if itl is not None:
            metrics.child(metrics.ITL, model).observe(itl)
        prompt = completion = None
        if usage:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                metrics.child(metrics.TOKENS, model, "prompt").inc(prompt)
            if isinstance(completion, int):
                metrics.child(metrics.TOKENS, model, "completion").inc(completion)
        logger.info("%s %s %s -> %s %s %.1f ms", request_id, model, pool.deployment,
                    replica or "-", status, (end - timing.arrived) * 1000)
        if self.usage is not None:
            self.usage.add(Usage(
                at=time.time(), request_id=request_id, key_id=key.key_id if key else None,
                username=user, model=model,
                deployment=pool.deployment, replica=replica, status=status, stream=stream,
                prompt_tokens=prompt if isinstance(prompt, int) else None,
                completion_tokens=completion if isinstance(completion, int) else None,
                queue_ms=(timing.sent - timing.arrived) * 1000 if timing.sent else 0.0,
                ttft_ms=ttft * 1000 if ttft is not None else None,
                itl_ms=itl * 1000 if itl is not None else None,
                e2e_ms=(end - timing.arrived) * 1000))


# --- helpers ----------------------------------------------------------------------------


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue


class ResponseTooLarge(Exception):
    pass


async def read_capped(response: Response, limit: int) -> bytes:
    """The whole upstream body, unless it grows beyond `limit` bytes."""
    parts, size = [], 0
    while chunk := await response.readany():
        size += len(chunk)
        if size > limit:
            raise ResponseTooLarge(f"the replica's answer is over the limit of {limit} bytes "
                                   f"(GATEWAY_MAX_RESPONSE_BYTES); ask for less, or stream it")
        parts.append(chunk)
    return b"".join(parts)


async def read_unless_gone(response: Response, receive: Receive, limit: int
                           ) -> bytes | None:
    """The whole upstream body (at most `limit` bytes), or None when the client
    disconnects first."""
    loop = asyncio.get_running_loop()
    reading = loop.create_task(read_capped(response, limit))
    watcher = loop.create_task(wait_for_disconnect(receive))
    try:
        await asyncio.wait({reading, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not reading.done():
        reading.cancel()
        return None
    return reading.result()


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


UPSTREAM_MESSAGE_CHARS = 1000


def upstream_error_body(status: int, payload: bytes) -> bytes:
    """An upstream error answer in OpenAI's shape: `{"error": {...}}` (vLLM's own, since
    0.10) passes as it is; vLLM's older `{"object": "error", "message": ...}` and
    FastAPI's `{"detail": ...}` are wrapped; anything else becomes the message, cut to a
    readable length. The status is kept by the caller."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            if isinstance(error.get("type"), str) and "param" in error and "code" in error:
                return payload
            return orjson.dumps({"error": {  # the fields a client reads, always there
                **error, "type": error["type"] if isinstance(error.get("type"), str)
                else "upstream_error", "param": error.get("param"),
                "code": error.get("code")}})
        if parsed.get("object") == "error" and isinstance(parsed.get("message"), str):
            return orjson.dumps({"error": {
                "message": parsed["message"][:UPSTREAM_MESSAGE_CHARS],
                "type": str(parsed.get("type") or "upstream_error"),
                "param": parsed.get("param") if isinstance(parsed.get("param"), str)
                else None,
                "code": parsed.get("code")}})
        if isinstance(parsed.get("detail"), str):
            payload = parsed["detail"].encode()
    text = payload.decode("utf-8", "replace").strip()
    if len(text) > UPSTREAM_MESSAGE_CHARS:
        text = text[:UPSTREAM_MESSAGE_CHARS] + "…"
    return orjson.dumps({"error": {
        "message": text or f"the upstream answered HTTP {status} with no body",
        "type": "upstream_error", "param": None, "code": "upstream_error"}})


def model_object(name: str, pool: Pool, created: int) -> dict[str, Any]:
    """A routable model name in OpenAI's model shape, with what a client may plan by."""
    return {"id": name, "object": "model", "created": created, "owned_by": "fleetplane",
            "root": pool.served_model_name, "max_model_len": pool.max_model_len,
            "ready_replicas": len(pool.replicas)}


async def respond(send: Send, status: int, body: bytes,
                  headers: list[tuple[bytes, bytes]]) -> None:
    names = {name for name, _ in headers}
    extra = [] if b"content-type" in names else [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + extra + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def take_usage(events: bytes, *, keep: bool) -> tuple[bytes, dict[str, Any] | None]:
    """Find the usage event among complete SSE events; drop it unless the client asked."""
    usage = None
    kept = []
    for event in events.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage"' in event:
            with contextlib.suppress(orjson.JSONDecodeError):
                usage = orjson.loads(event[6:]).get("usage")
            if not keep:
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept), usage


gateway = Gateway()
