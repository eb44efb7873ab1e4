"""The data plane's one public API: a call placed on a replica, for as long as its answer
is read, with every account settled when it ends.

    async with gateway.session(call) as stream:
        ...  # read stream.response; say how it went: stream.ended(usage), stream.broke()

The HTTP front door (serving/gateway/app.py) and the playground (serving/playground.py)
both use it, so a request counts the same whichever way it came: entering waits for a
replica scaled up from zero, takes a slot of the priority queue, places the call (retrying
before the first byte) and counts it in flight; refusals are recorded there. Leaving
releases the connection and the slot, tells the router how the replica did, charges or
gives back tokens, and writes the metrics and the usage record. A caller cancelled while
inside (a client gone, a stopped generation) is recorded as 499 and its upstream closed,
so the engine frees the request's cache.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from serving import metrics
from serving.gateway.accounting import record, tokens_owed
from serving.gateway.call import Call
from serving.gateway.placement import place, release_slot, replica_failed
from serving.gateway.resources import Resources
from serving.routes import RouteReplica
from serving.upstream import Response


class Stream:
    """The answer of the replica a call was placed on, and how it went."""

    __slots__ = ("_call", "_resources", "completed", "replica", "response", "status",
                 "usage")

    def __init__(self, resources: Resources, call: Call, replica: RouteReplica,
                 response: Response) -> None:
        self._resources, self._call = resources, call
        self.replica, self.response = replica, response
        self.status = response.status  # as recorded: the replica's, or what the caller set
        self.usage: dict[str, Any] | None = None  # the engine's token counts, when given
        self.completed = False

    def ended(self, usage: dict[str, Any] | None = None) -> None:
        """The answer was read to its end (or the caller left): the replica is healthy."""
        self.completed = True
        if usage is not None:
            self.usage = usage

    def broke(self) -> None:
        """The replica failed while answering: it sits out a while, and it is counted."""
        replica_failed(self._resources, self._call, self.replica.name)


class Session:
    """`async with` a call on a replica (see the module's text)."""

    __slots__ = ("call", "resources", "stream")

    def __init__(self, resources: Resources, call: Call) -> None:
        self.resources, self.call = resources, call
        self.stream: Stream | None = None

    async def __aenter__(self) -> Stream:
        """Place the call; refusals raise GatewayError (recorded, budget given back)."""
        call, resources = self.call, self.resources
        try:
            replica, response = await place(resources, call)
        except BaseException:
            if call.limits and not call.answered:  # no replica answered: no budget used
                resources.spawn(resources.refund(call.limits))
            raise
        metrics.child(metrics.IN_FLIGHT, call.model, call.deployment).inc()
        self.stream = Stream(resources, call, replica, response)
        return self.stream

    async def __aexit__(self, kind: type[BaseException] | None,
                        error: BaseException | None, trace: TracebackType | None) -> None:
        """Settle every account of the call."""
        stream, call, resources = self.stream, self.call, self.resources
        assert stream is not None
        if isinstance(error, asyncio.CancelledError):
            stream.status = 499
            stream.response.close()  # the engine sees the connection go and stops
        stream.response.release()
        resources.router.state(stream.replica.name).in_flight -= 1
        release_slot(resources, call)
        metrics.child(metrics.IN_FLIGHT, call.model, call.deployment).dec()
        if stream.completed:
            resources.router.succeeded(stream.replica.name)
        charges = tokens_owed(call, stream.status, stream.usage)
        if charges:
            resources.owe(charges)
        record(resources.usage, call, stream.replica.name, stream.status, stream.usage)
