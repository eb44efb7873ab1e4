"""The server's HTTP/1.1 protocol: uvicorn's (httptools), with each response's status line
and headers written together with its first body bytes when the application sends them
in the same turn of the event loop.

uvicorn writes the head at `http.response.start` and each body at its `http.response.body`,
one socket write apiece. An answer that is whole when it starts (a short completion, an
embedding, an error, a page) then costs the server two writes and the client two reads,
where one of each does: on loopback a write is most of a small request's system time. The
head is held back only until the end of the current turn of the event loop, never longer:
a stream whose first token is still coming gets its head at once, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadHeldTransport:
    """One response's view of the connection's transport: its first write (the head) is
    held until the next write, which carries it along, or until the end of this turn of
    the event loop; every other call goes to the transport."""

    __slots__ = ("first", "held", "loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport, self.loop = transport, loop
        self.held: bytes | None = None
        self.first = True

    def write(self, data: bytes) -> None:
        """Write `data`, after the held head; the first write is held."""
        if self.first:
            self.first = False
            self.held = data
            self.loop.call_soon(self.flush)
            return
        held, self.held = self.held, None
        self.transport.write(data if held is None else held + data)

    def flush(self) -> None:
        """Write the head still held (nothing followed it in its turn)."""
        held, self.held = self.held, None
        if held is not None and not self.transport.is_closing():
            self.transport.write(held)

    def close(self) -> None:
        """Close the connection once what is held and buffered is written."""
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, each request's response written through a
    HeadHeldTransport (WebSocket upgrades are left as they are)."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a new request's response
            cycle.transport = HeadHeldTransport(self.transport, self.loop)  # type: ignore[assignment]
