"""Where a call goes: a deployment scaled to zero is waited for (cold start), the call
takes a slot of its context pool's priority queue (serving/admission.py), the router picks
a replica, and a failure before the answer begins is retried on another one.

Refusals (a full queue, a wait run out, no replica) and a client that leaves the queue
are recorded here; an answered call is recorded by the session when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from django.conf import settings

from serving import metrics
from serving.admission import Refused, Ticket, retry_after_header
from serving.calls import GatewayError
from serving.demand import demand
from serving.gateway.accounting import record
from serving.gateway.call import Call, Receive
from serving.gateway.resources import Resources
from serving.hot_settings import hot
from serving.routes import DeploymentRoutes, RouteReplica, replica_auth, routes
from serving.upstream import Response, UpstreamError

MAX_ATTEMPTS = 3
RETRY_STATUSES = {500, 502, 503, 504}


async def place(resources: Resources, call: Call) -> tuple[RouteReplica, Response]:
    """Send the call to a replica the router picks, retrying on another one when it fails
    before answering; the chosen replica's in-flight count includes it. When every
    replica of its context pool is full, wait in the priority queue first: the slot
    taken is `call.ticket`, given back with `release_slot`."""
    if not call.routes.replicas and call.routes.wakes:
        call.routes = await wait_for_replica(resources, call)
    pool = call.routes.context_pool_for(call.prompt_tokens)
    call.routes = call.routes.narrowed_to(pool)
    healthy = len(resources.router.healthy(call.routes))
    if healthy:
        await take_slot(resources, call, f"{call.deployment}|{pool}", healthy)
    try:
        return await send_to_replica(resources, call)
    except BaseException:
        release_slot(resources, call, finished=False)
        raise


async def take_slot(resources: Resources, call: Call, lane: str, healthy: int) -> None:
    """A slot in the call's lane of the priority queue, into `call.ticket`; a refusal is
    recorded and answered as a GatewayError."""
    priority = call.priority_class()
    try:
        call.ticket = await wait_for_slot(
            resources, call, lane, healthy * call.routes.replica_concurrency)
    except asyncio.CancelledError:
        # The client left while waiting; counted like a client that leaves mid-answer.
        record(resources.usage, call, "", 499, None)
        raise
    except Refused as exc:
        metrics.child(metrics.REFUSED, call.deployment, exc.code).inc()
        record(resources.usage, call, "", exc.status, None)
        raise GatewayError(exc.status, exc.message, kind="rate_limit_error"
                           if exc.status == 429 else "service_unavailable",
                           code=exc.code,
                           headers=[retry_after_header(exc.retry_after)]) from None
    if call.ticket.position:
        metrics.child(metrics.QUEUE_WAIT, call.deployment, priority.name).observe(
            call.ticket.waited)


async def wait_for_slot(resources: Resources, call: Call, lane: str,
                        capacity: int) -> Ticket:
    """A slot from the priority queue. With `call.receive` (an HTTP request), a client
    that disconnects while it waits leaves the queue at once: the server does not cancel
    the request's task, it only says so through `receive`."""
    admission, priority = resources.admission, call.priority_class()
    ticket = admission.try_acquire(lane, capacity, priority)
    if ticket is not None:
        return ticket
    acquiring = asyncio.ensure_future(admission.acquire(lane, capacity, priority,
                                                        call.owner))
    if call.receive is None:
        return await acquiring
    watcher = asyncio.ensure_future(wait_for_disconnect(call.receive))
    try:
        await first_done(acquiring, watcher)
    except asyncio.CancelledError:
        acquiring.cancel()
        raise
    finally:
        watcher.cancel()
    if not acquiring.done():  # the client went away first
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError, Refused):
            await acquiring
        call.client_left = True
        raise asyncio.CancelledError
    return acquiring.result()


def release_slot(resources: Resources, call: Call, *, finished: bool = True) -> None:
    """Give back the admission slot of a call that has ended (once)."""
    ticket, call.ticket = call.ticket, None
    if ticket is not None:
        resources.admission.release(ticket.lane, finished=finished)


async def send_to_replica(resources: Resources, call: Call
                          ) -> tuple[RouteReplica, Response]:
    """The first replica that answers, of up to MAX_ATTEMPTS the router picks."""
    router, model = resources.router, call.model
    tried: list[str] = []
    base_headers = (("Content-Type", "application/json"), ("X-Request-Id", call.request_id))
    response: Response | None = None
    replica: RouteReplica | None = None
    last_error = ""
    # A replica silent this long is taken for hung (its socket stays open while it is).
    idle = hot.GATEWAY_UPSTREAM_IDLE_SECONDS or None
    for attempt in range(MAX_ATTEMPTS):
        replica = router.choose(call.routes, session=call.affinity, prefix=call.prefix,
                                exclude=tried)
        if replica is None:
            break
        if attempt:
            metrics.child(metrics.RETRIES, model).inc()
        tried.append(replica.name)
        state = router.state(replica.name)
        state.in_flight += 1
        call.timing.sent = time.perf_counter()
        # Replicas demand their deployment's engine key (an external endpoint its own).
        upstream_headers = (*base_headers, *replica_auth(replica))
        try:
            response = await resources.connections.request(
                "POST", replica.url, call.path, call.raw, upstream_headers,
                # A stream's head comes at once, a whole answer's only once it is done.
                head_timeout=idle if call.stream else None, idle_timeout=idle)
        except UpstreamError as exc:
            state.in_flight -= 1
            replica_failed(resources, call, replica.name)
            last_error = f"{replica.name}: {exc}"
            response = None
            continue
        except asyncio.CancelledError:  # the caller went away before the answer began
            state.in_flight -= 1
            raise
        if response.status in RETRY_STATUSES and attempt + 1 < MAX_ATTEMPTS:
            state.in_flight -= 1
            replica_failed(resources, call, replica.name)
            last_error = f"{replica.name}: HTTP {response.status}"
            response.release()
            response = None
            continue
        break
    if response is None or replica is None:
        message = (f"no ready replica for model `{model}`" if not tried else
                   f"every replica failed before answering ({last_error})")
        record(resources.usage, call, "", 503, None)
        raise GatewayError(503, message, kind="service_unavailable", code="no_replica",
                           headers=[(b"retry-after", b"2")])
    call.answered = True
    return replica, response


def replica_failed(resources: Resources, call: Call, replica: str) -> None:
    """A replica failed the call: it sits out a while, and the failure is counted."""
    resources.router.failed(replica)
    metrics.child(metrics.UPSTREAM_ERRORS, call.model, call.deployment).inc()


async def wait_for_replica(resources: Resources, call: Call) -> DeploymentRoutes:
    """A deployment scaled to zero: wait (up to GATEWAY_COLD_START_WAIT_SECONDS) while
    the autoscaler, told by the demand count, brings a replica up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.GATEWAY_COLD_START_WAIT_SECONDS
    deployment, connection = call.deployment, resources.redis
    published = 0.0
    demand.add(deployment, 1)
    try:
        while True:
            current = routes.table.routes_for(call.model) or call.routes
            if current.replicas or not current.wakes:
                return current
            now = loop.time()
            if now >= deadline:
                raise GatewayError(
                    503, f"no replica of `{call.model}` came up within "
                         f"{settings.GATEWAY_COLD_START_WAIT_SECONDS:g} s",
                    kind="service_unavailable", code="no_replica",
                    headers=[(b"retry-after", b"10")])
            if connection is not None and now - published >= 1.0:
                await demand.publish(connection, deployment)
                published = now
            await asyncio.sleep(0.05)
    finally:
        demand.add(deployment, -1)
        if connection is not None and published:
            await demand.publish(connection, deployment)


async def first_done(*futures: asyncio.Future[Any]) -> None:
    """Wait until one of these tasks is done, without its result or its error: what
    asyncio.wait(FIRST_COMPLETED) does for them, without its set, its checks and its
    bookkeeping (this runs for every request)."""
    for future in futures:  # a loop, not any() over a generator: per request
        if future.done():
            return
    either = asyncio.get_running_loop().create_future()

    def done(_: object) -> None:
        if not either.done():
            either.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    try:
        await either
    finally:
        for future in futures:
            future.remove_done_callback(done)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the HTTP client has gone."""
    while (await receive())["type"] != "http.disconnect":
        continue
