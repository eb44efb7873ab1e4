"""The server's HTTP/1.1 protocol: uvicorn's (httptools), with each response's status line
and headers written together with its first body bytes when the application sends them
in the same turn of the event loop, and a way to write a chunk of a streamed body at once.

uvicorn writes the head at `http.response.start` and each body at its `http.response.body`,
one socket write apiece. An answer that is whole when it starts (a short completion, an
embedding, an error, a page) then costs the server two writes and the client two reads,
where one of each does: on loopback a write is most of a small request's system time. The
head is held back only until the end of the current turn of the event loop, never longer:
a stream whose first token is still coming gets its head at once, as before.

Each request's scope carries `extensions["fleetplane.write_body"]`, a plain function
`(body, more_body) -> bool` that writes one chunk of a chunked answer already started, as
uvicorn's `send` of an `http.response.body` message would, without the message, the
coroutine and its checks: the gateway relays every streamed token through it (about a
tenth of the CPU per relayed event). It returns False, writing nothing, when the chunk
must go the ASGI way (the client reads slower than the answer comes, it has gone, the
answer is not chunked or not started).

And `extensions["fleetplane.pipe"]`, a function `(pipe)` that gives a Pipe of the
gateway's upstream client (serving/upstream/pipe.py) the connection's transport, and opens
it once the answer's head is written, if the answer is chunked: the replica's chunks then
go to the client as they came, each from the upstream socket's callback. The server closes
it while the client reads slower than the answer comes (uvicorn's flow control pauses the
writing), when the client goes and when the answer ends; a chunk that cannot go through
it comes through `write_body` or the ASGI send.

It carries `extensions["fleetplane.when_lost"]` too, a function `(callback | None)` that
has `callback()` called once, from the connection's callback, if the client goes before
the response is complete (at once when it has gone already); None takes it back. The
gateway follows a stream this way: no task per stream waits on `receive` to learn it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

# The scope's extensions holding HeadHeldTransport.write_body and .when_lost; the gateway
# reads them under the same names (serving/gateway/call.py), without importing the server.
WRITE_BODY = "fleetplane.write_body"
WHEN_LOST = "fleetplane.when_lost"
PIPE = "fleetplane.pipe"


class HeadHeldTransport:
    """One response's view of the connection's transport: its first write (the head) is
    held until the next write, which carries it along, or until the end of this turn of
    the event loop; every other call goes to the transport.

    It knows its request's cycle by a weak reference: the cycle holds it (as its
    transport, and through the scope's `write_body`), and a strong reference back would
    make every request's objects a reference cycle, left for the cycle collector to find
    and free rather than freed when the request ends (scanned again and again by
    collections while they wait)."""

    __slots__ = ("cycle", "first", "held", "loop", "on_lost", "piped", "stopped", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 cycle: RequestResponseCycle) -> None:
        self.transport, self.loop = transport, loop
        self.cycle = weakref.ref(cycle)
        self.held: bytes | None = None
        self.first = True
        self.on_lost: Callable[[], None] | None = None
        self.piped: Any = None  # the Pipe given to `pipe`, opened once the head is out
        self.stopped = False  # the pipe is closed for good: the client went, or the end

    def write(self, data: bytes) -> None:
        """Write `data`, after the held head; the first write is held."""
        if self.first:
            self.first = False
            self.held = data
            self.loop.call_soon(self.flush)
            return
        held, self.held = self.held, None
        self.transport.write(data if held is None else held + data)
        if held is not None and self.piped is not None:
            self.steer_pipe()

    def flush(self) -> None:
        """Write the head still held (nothing followed it in its turn)."""
        held, self.held = self.held, None
        if held is not None and not self.transport.is_closing():
            self.transport.write(held)
            if self.piped is not None:
                self.steer_pipe()

    def pipe(self, pipe: Any) -> None:
        """Give `pipe` the transport; it is open while the head is written, the answer
        chunked (not one sent with its length), writing not paused, the client there and
        the answer not ended (see the module's text)."""
        pipe.transport = self.transport
        self.piped = pipe
        self.steer_pipe()

    def steer_pipe(self, stop: bool = False) -> None:
        """Open or close the pipe, if any, as things stand; `stop`: closed for good."""
        self.stopped = self.stopped or stop
        if self.piped is not None:
            cycle = self.cycle()
            self.piped.open = (not self.stopped and not self.first and self.held is None
                               and cycle is not None and cycle.chunked_encoding is True
                               and not cycle.flow.write_paused and not cycle.disconnected)

    def close(self) -> None:
        """Close the connection once what is held and buffered is written."""
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def when_lost(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once if the client goes before the response is complete (now,
        if it has gone already); None: no longer."""
        cycle = self.cycle()
        if callback is not None and (cycle is None or cycle.disconnected):
            callback()
            return
        self.on_lost = callback

    def lost(self) -> None:
        """The client went: the pipe closes; the callback asked for, if any, once."""
        self.steer_pipe(stop=True)
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()

    def write_body(self, body: bytes, more_body: bool) -> bool:
        """One chunk of the chunked answer, written now (see the module's text)."""
        cycle = self.cycle()
        if (cycle is None or cycle.flow.write_paused or cycle.disconnected
                or not cycle.response_started or cycle.response_complete
                or not cycle.chunked_encoding):
            return False
        if more_body:
            if body:
                chunk = b"%x\r\n%b\r\n" % (len(body), body)
                if self.first:  # write's work, inline: this runs for every chunk relayed
                    self.write(chunk)
                else:
                    held, self.held = self.held, None
                    self.transport.write(chunk if held is None else held + chunk)
                    if held is not None and self.piped is not None:
                        self.steer_pipe()
            return True
        self.steer_pipe(stop=True)
        self.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.close()
        cycle.on_response()
        return True


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each request's response written through a
    HeadHeldTransport, whose `write_body` and `when_lost` are in the request's scope
    (WebSocket upgrades are left as they are)."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a new request's response
            transport = HeadHeldTransport(self.transport, self.loop, cycle)
            cycle.transport = transport  # type: ignore[assignment]
            extensions: dict[str, Any] = {**cycle.scope.get("extensions", {}),
                                          WRITE_BODY: transport.write_body,
                                          WHEN_LOST: transport.when_lost,
                                          PIPE: transport.pipe}
            cycle.scope["extensions"] = extensions

    def pause_writing(self) -> None:
        """The client reads slower than the answer comes: its pipe closes until it
        catches up (uvicorn's flow control holds the ASGI sends meanwhile)."""
        super().pause_writing()
        self.steer_pipe()

    def resume_writing(self) -> None:
        """The client caught up: its pipe opens again."""
        super().resume_writing()
        self.steer_pipe()

    def steer_pipe(self) -> None:
        """The current response's pipe, if any, opened or closed as writing now stands."""
        transport = self.cycle.transport if self.cycle is not None else None
        if isinstance(transport, HeadHeldTransport):
            transport.steer_pipe()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        cycle = self.cycle  # disconnected: the client went before its answer was complete
        if cycle is not None and cycle.disconnected and isinstance(cycle.transport,
                                                                   HeadHeldTransport):
            cycle.transport.lost()
