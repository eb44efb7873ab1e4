"""One keep-alive HTTP/1.1 connection to a replica (an asyncio protocol parsing with
httptools), and the Response it hands the caller: status and headers at once, the body read
as it arrives or delivered to a sink from the socket's callback."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING

import httptools

from serving.upstream.eager import Unfinished
from serving.upstream.pipe import PIPED_READ_MAX, SIZE_LINES, Pipe

if TYPE_CHECKING:
    from serving.upstream.pool import ConnectionPool

HIGH_WATER = 1 << 20  # bytes buffered before the socket stops being read


class UpstreamError(Exception):
    """The replica could not be reached, or the connection broke before the answer ended."""


class UpstreamStalled(UpstreamError):
    """The replica sent nothing for the caller's limit: its process may be hung (stopped,
    deadlocked) while its socket stays open, which no connection error would ever say."""




# Takes body bytes, and whether the answer ends with them; returns None when it is done
# with them, else what to await before it can take more (a client reading slower than the
# replica writes).
Sink = Callable[[bytes, bool], Awaitable[None] | None]


class Response:
    """One upstream answer: status and headers at once, the body as it arrives."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(self, connection: Connection, status: int, headers: dict[str, str]) -> None:
        self._connection = connection
        self.status = status
        self.headers = headers

    async def readany(self) -> bytes:
        """Every body byte buffered now (waiting for some if none is); b"" at the end."""
        return await self._connection.read_some()

    def deliver(self, sink: Sink, pipe: Pipe | None = None) -> Awaitable[None]:
        """Hand every body byte to `sink` as it arrives, until the end (the replica's
        error is raised): straight from the socket's callback while the caller waits, so a
        chunk costs no wake-up of the caller's task. The sink is told when the bytes it
        gets are the last (when the end came with them). With `pipe`, each chunk that may
        go through it does, as it came (see Pipe)."""
        return self._connection.deliver(sink, pipe)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to its pool when the answer was read to
        the end and the replica keeps it open, else it is closed."""
        self._connection.finish()

    def close(self) -> None:
        """Drop the connection now (the replica sees the client go and stops)."""
        self._connection.abort()


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a replica, one request at a time."""

    def __init__(self, pool: ConnectionPool, key: tuple[str, int, bool]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.parser: httptools.HttpResponseParser | None = None
        self.busy = False
        self.received = False  # any byte of the current answer
        self.head: asyncio.Future[Response] | None = None
        self.header_names: list[bytes] = []
        self.header_values: list[bytes] = []
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None  # takes the body as it arrives (deliver)
        self.pipe: Pipe | None = None  # offered each chunk first (deliver)
        self.between_chunks = False  # the parser is between two chunks of a chunked body
        self.held: Awaitable[None] | None = None  # what the sink waits on before more
        self.length_known = False
        self.keep_alive = False
        # Silence limits, set per request (None: no limit): for the status and headers,
        # then for each wait after them. One watchdog timer per connection checks them
        # when they may have run out, so no chunk pays for a timer of its own.
        self.head_timeout: float | None = None
        self.idle_timeout: float | None = None
        self.loop = asyncio.get_running_loop()
        # When the request was sent or bytes last came (time.perf_counter, the clock the
        # piped chunks are timed by, read once per read); kept while the connection waits
        # in the pool (the end of its last answer: serving/upstream/pool.py).
        self.last_heard = 0.0
        self.watchdog: asyncio.TimerHandle | None = None
        self.watchdog_due = 0.0
        self.opened_at = 0.0  # when the socket opened (time.perf_counter)

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The socket is open."""
        self.transport = transport  # type: ignore[assignment]
        self.opened_at = perf_counter()

    def data_received(self, data: bytes) -> None:
        """Feed the answer's bytes to the parser, or a chunk to the pipe (see Pipe)."""
        self.last_heard = now = perf_counter()
        pipe = self.pipe
        # This runs for every chunk piped: as few calls as the tests allow. The size line
        # by a table lookup (the one a chunk of this read's length has), not parsed; find,
        # not `in` (`bytes in bytes` raises and clears a TypeError first: an int?).
        if (pipe is not None and pipe.open and not pipe.behind and self.between_chunks
                and self.held is None and not self.body and len(data) <= PIPED_READ_MAX
                and data.startswith(SIZE_LINES[len(data)]) and data.endswith(pipe.ending)
                and data.find(pipe.refused) < 0):
            pipe.transport.write(data)  # type: ignore[union-attr]
            if not pipe.chunks:
                pipe.first = now
            pipe.last = now
            pipe.chunks += 1
            pipe.found += data.count(pipe.counted)
            return
        # (A piped read is never an answer's first: the pipe waits for its head parsed.)
        self.received = True
        parser = self.parser
        if parser is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        try:
            parser.feed_data(data)  # (its chunk callbacks keep `between_chunks` current)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"malformed answer from the replica: {exc}"))
            self.abort()
            return
        # Whatever this read brought, in one piece, to the sink while nothing holds it.
        if self.body and self.sink is not None and self.held is None:
            self.hand_over()

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket closed: an answer in progress ends or fails."""
        by_replica = not self.closed
        self.closed = True
        if self.pool.forget(self) and by_replica:  # it was waiting in the pool
            self.pool.closed_while_idle(self)
        if self.busy and not self.complete:
            if self.head is not None and self.head.done() and not self.length_known and exc is None:
                self.on_message_complete()  # a body delimited by the connection's end
            else:
                self.fail(
                    UpstreamError(
                        "the replica closed the connection" + (f" ({exc})" if exc else "")
                    )
                )

    def pause_writing(self) -> None:
        """Nothing to hold back: requests are small."""

    def resume_writing(self) -> None:
        """Nothing was held back."""

    # --- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header of the answer (httptools)."""
        self.header_names.append(name)
        self.header_values.append(value)

    def on_headers_complete(self) -> None:
        """Status and headers known: the caller gets the Response."""
        assert self.parser is not None
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in zip(self.header_names, self.header_values, strict=True)
        }
        chunked = "chunked" in headers.get("transfer-encoding", "")
        self.length_known = "content-length" in headers or chunked
        status = self.parser.get_status_code()
        # A chunked body is next: the parser is between chunks until its first size line.
        self.between_chunks = chunked and status >= 200 and status not in (204, 304)
        if self.head is not None and not self.head.done():
            self.head.set_result(Response(self, status, headers))
        self.watch()  # from now on the idle limit applies

    def on_body(self, body: bytes) -> None:
        """A piece of the body; reading pauses past HIGH_WATER bytes."""
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self.pause()
        if self.sink is None:  # a sink is handed the body once the read is parsed
            self.wake()

    def on_chunk_header(self) -> None:
        """A chunk's size line is parsed: the parser is inside the chunk (httptools)."""
        self.between_chunks = False

    def on_chunk_complete(self) -> None:
        """A chunk and its CRLF are parsed: the next byte starts a size line (httptools).
        Wherever a read ended, the pipe may take the next one that is a whole chunk."""
        self.between_chunks = True

    def on_message_complete(self) -> None:
        """The answer ended."""
        self.complete = True
        # Asked now: the parser forgets it once the message is over.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()
        self.wake()

    # --- used by the client ------------------------------------------------------------

    def pause(self) -> None:
        """Stop reading the socket (the replica waits) until `resume`."""
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the socket again."""
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def take_body(self) -> bytes:
        """Every body byte buffered, in one piece; reading resumes."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused:  # (asked here: a call saved for every chunk relayed)
            self.resume()
        return data

    def hand_over(self) -> None:
        """The buffered body to the sink; when it must wait, reading pauses and `deliver`
        waits for it."""
        assert self.sink is not None
        last = self.complete and self.error is None
        try:
            held = self.sink(self.take_body(), last)
        except Exception as exc:  # the caller's failure ends the answer
            self.fail(exc)
            self.abort()
            return
        if held is not None:
            self.held = held
            self.pause()
            self.wake()

    def wake(self) -> None:
        """Wake the reader waiting for body bytes."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        """The answer cannot complete: the waiting caller gets `error`."""
        self.error = error
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        self.wake()

    def stall(self, seconds: float) -> None:
        """Nothing came within the caller's limit: the answer fails, the connection is
        dropped (a replica that wakes up again sees its client gone)."""
        if self.busy and not self.complete and self.error is None:
            self.fail(UpstreamStalled(f"the replica sent nothing for {seconds:g} s"))
            self.abort()

    def limit(self) -> float | None:
        """The silence limit that applies now: before the status and headers, then after."""
        waiting_for_head = self.head is not None and not self.head.done()
        return self.head_timeout if waiting_for_head else self.idle_timeout

    def watch(self) -> None:
        """Arm the watchdog for the limit that applies now, unless it is armed to look
        soon enough. A timer armed for an earlier request on this connection is kept: it
        looks again when it fires, and arming one per request costs more than that."""
        limit = self.limit()
        if not limit:
            return
        due = self.last_heard + limit
        if self.watchdog is not None:
            if self.watchdog_due <= due:
                return
            self.watchdog.cancel()
        self.watchdog_due = due
        self.watchdog = self.loop.call_later(due - perf_counter(), self.check_silence)

    def check_silence(self) -> None:
        """The watchdog: stall the answer if the replica has been silent past the limit
        (not while reading is paused: that silence is the caller's), else look again when
        it could be."""
        self.watchdog = None
        limit = self.limit()
        if not limit or not self.busy or self.complete or self.error is not None:
            return
        if self.paused:
            self.last_heard = perf_counter()
        elif perf_counter() - self.last_heard >= limit - 0.001:  # timers may fire early
            self.stall(limit)
            return
        self.watch()

    def unwatch(self) -> None:
        """Disarm the watchdog."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None

    async def send(self, request: bytes) -> Response:
        """Write one request; wait for the answer's status and headers (at most
        `head_timeout` seconds, when set)."""
        if self.closed or self.transport is None:
            raise UpstreamError("the replica closed the connection")
        self.busy, self.received, self.complete, self.error = True, False, False, None
        self.keep_alive = self.between_chunks = False
        self.header_names, self.header_values = [], []
        self.body.clear()
        self.buffered = 0
        self.parser = httptools.HttpResponseParser(self)
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        self.last_heard = perf_counter()
        self.watch()
        try:
            return await self.head
        except BaseException:
            self.abort()
            raise

    async def read_some(self) -> bytes:
        """Every body byte buffered now (waiting for some); b"" at the end."""
        while not self.body:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.take_body()

    async def deliver(self, sink: Sink, pipe: Pipe | None = None) -> None:
        """Hand the body to `sink` as it arrives, until it ends (see Response.deliver)."""
        self.sink, self.pipe = sink, pipe
        try:
            while True:
                if self.held is not None:
                    held = self.held
                    await held
                    self.held = None
                    self.resume()
                elif self.body:
                    self.hand_over()
                elif self.error is not None:
                    raise self.error
                elif self.complete:
                    return
                else:
                    self.waiter = self.loop.create_future()
                    try:
                        await self.waiter
                    finally:
                        self.waiter = None
        finally:
            self.sink = self.pipe = None
            if isinstance(self.held, Unfinished):
                self.held.close()
            self.held = None

    def finish(self) -> None:
        """The caller is done: back to the pool if reusable, else closed."""
        if not self.busy:
            return
        self.busy = False
        reusable = self.complete and self.error is None and not self.closed and self.keep_alive
        self.parser, self.head = None, None
        self.body.clear()
        if reusable:  # its watchdog stays armed for the next request (see watch)
            self.pool.put_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection now."""
        self.busy = False
        self.unwatch()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
        self.pool.forget(self)
