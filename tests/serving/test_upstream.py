"""The gateway's upstream HTTP client against real sockets: a small raw HTTP/1.1 server
written here answers exactly the bytes each case needs (sized, chunked, close-delimited,
broken), so the edge cases the relay meets in the field are reproduced on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from serving.upstream import ConnectionPool, UpstreamError, UpstreamStalled, start


async def until(check: Callable[[], bool], what: str, seconds: float = 5) -> None:
    """Wait (bounded) until `check()` holds."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.handler: Handler | None = None
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        assert self.handler is not None
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RawServer]:
    raw = RawServer()
    await raw.start()
    yield raw
    assert raw.server is not None
    raw.server.close()


def sized(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def test_sized_answers_reuse_one_kept_alive_connection(server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await server.read_request(reader)
            writer.write(sized(b'{"echo":' + body + b"}"))
            await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    for number in range(3):
        response = await pool.request(
            "POST", server.url, "/v1/completions", b'{"n":%d}' % number, (("X-Request-Id", "abc"),)
        )
        assert response.status == 200
        assert response.headers["content-type"] == "application/json"
        assert await response.read() == b'{"echo":{"n":%d}}' % number
        response.release()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"X-Request-Id: abc\r\n" in first and b"Content-Length: 7\r\n" in first
    pool.close()


async def test_a_chunked_stream_arrives_piece_by_piece(server: RawServer) -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        await go_on.wait()  # the second event only after the client has the first
        writer.write(b"8\r\ndata: 2\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url + "/prefix/", "/v1/x", b"{}")
    assert response.headers["content-type"] == "text/event-stream"
    assert await response.readany() == b"data: 1\n"
    go_on.set()
    assert await response.readany() == b"data: 2\n"
    assert await response.readany() == b""
    response.release()
    assert server.requests[0].startswith(b"POST /prefix/v1/x HTTP/1.1")
    pool.close()


async def test_a_body_ended_by_closing_the_connection_is_complete(server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("GET", server.url, "/metrics")
    assert await response.read() == b"all of it"
    response.release()
    assert not pool.idle.get(("127.0.0.1", int(server.url.rsplit(":", 1)[1]), False))
    pool.close()


async def test_a_connection_that_breaks_mid_body_raises(server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    with pytest.raises(UpstreamError, match="closed the connection"):
        await response.read()
    response.release()
    pool.close()


async def test_a_kept_alive_connection_closed_by_the_replica_is_replaced(server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(sized(b"{}"))  # keep-alive promised, then closed right away
        await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    for _ in range(2):
        response = await pool.request("POST", server.url, "/v1/completions", b"{}")
        assert await response.read() == b"{}"
        response.release()
        await until(lambda: all(c.closed for idle in pool.idle.values() for c in idle),
                    "the replica's close to reach the pooled connection")
    assert server.connections == 2
    pool.close()


async def test_an_unreachable_replica_raises_upstream_error() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    pool = ConnectionPool()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.request("POST", f"http://127.0.0.1:{port}", "/v1/completions", b"{}")
    with pytest.raises(UpstreamError, match="not an http"):
        await pool.request("POST", "ftp://example.invalid", "/v1/completions", b"{}")


async def test_closing_a_response_tells_the_replica_at_once(server: RawServer) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        if await reader.read() == b"":
            gone.set()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    assert await response.readany() == b"abc"
    response.close()
    await asyncio.wait_for(gone.wait(), 2)
    pool.close()


async def test_a_fast_replica_is_read_with_bounded_memory(server: RawServer) -> None:
    piece = b"x" * 65536
    total = 64 * len(piece)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        for _ in range(64):
            writer.write(piece)
            await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("GET", server.url, "/big")
    connection = response._connection
    # The replica writes as fast as it can meanwhile: reading stops past the high water.
    await until(lambda: connection.paused, "the socket to stop being read")
    assert connection.buffered < 4 * 1024 * 1024
    assert len(await response.read()) == total
    response.release()
    pool.close()


async def test_a_header_value_cannot_smuggle_another_header(server: RawServer) -> None:
    pool = ConnectionPool()
    with pytest.raises(UpstreamError, match="line break"):
        await pool.request("POST", server.url, "/v1/completions", b"{}",
                           (("X-Request-Id", "a\r\nX-Evil: 1"),))
    assert server.requests == []


async def test_a_replica_silent_past_the_idle_limit_fails_the_read_and_loses_its_connection(
        server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await reader.read()  # then nothing more, as a stopped process, until the client goes

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}",
                                  head_timeout=0.3, idle_timeout=0.3)
    assert await response.readany() == b"data: "
    with pytest.raises(UpstreamStalled, match=r"sent nothing for 0\.3 s"):
        await response.readany()
    response.release()
    assert not any(pool.idle.values())  # never handed to another request
    pool.close()


async def test_a_replica_that_never_answers_fails_within_the_head_limit_on_one_connection(
        server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await server.read_request(reader)
            if body == b"{}":
                await reader.read()  # silent: its socket open, nothing written
            writer.write(sized(b"{}"))
            await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    kept = await pool.request("POST", server.url, "/v1/completions", b"[]")
    await kept.read()
    kept.release()  # a kept-alive connection the next request takes
    with pytest.raises(UpstreamStalled):
        await pool.request("POST", server.url, "/v1/completions", b"{}", head_timeout=0.3)
    # Not sent again on a new connection: that one would wait just as long.
    assert server.connections == 1 and len(server.requests) == 2
    pool.close()


async def test_a_stream_that_keeps_sending_outlives_its_idle_limit_many_times(
        server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(12):  # 1.2 s of pieces 0.1 s apart, against a limit of 0.3 s
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}",
                                  head_timeout=0.3, idle_timeout=0.3)
    assert await response.read() == b"x" * 12
    response.release()
    pool.close()


async def test_delivered_reads_come_in_one_piece_each_and_in_order(server: RawServer) -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        # Three chunks in one write: the sink gets them as one piece.
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\nab\r\n2\r\ncd\r\n2\r\nef\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"2\r\ngh\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    pieces: list[tuple[bytes, bool]] = []

    def sink(data: bytes, last: bool) -> None:
        pieces.append((data, last))
        go_on.set()

    await asyncio.wait_for(response.deliver(sink), 5)
    # The end came in the same read as the last piece: the sink was told.
    assert pieces == [(b"abcdef", False), (b"gh", True)]
    response.release()
    pool.close()


async def test_a_sink_that_must_wait_holds_the_rest_back_until_it_is_done(
        server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for number in range(20):
            writer.write(b"3\r\n%03d\r\n" % number)
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    pieces: list[bytes] = []
    slow_client = asyncio.Event()

    async def write_later(data: bytes) -> None:
        await slow_client.wait()
        pieces.append(data)

    def sink(data: bytes, last: bool) -> Awaitable[None] | None:
        if pieces:
            pieces.append(data)
            return None
        return write_later(data)  # the first piece waits for a slow client

    delivering = asyncio.ensure_future(response.deliver(sink))
    await until(lambda: response._connection.paused, "reading to pause for the sink")
    assert pieces == []
    slow_client.set()
    await asyncio.wait_for(delivering, 5)
    assert b"".join(pieces) == b"".join(b"%03d" % n for n in range(20))
    response.release()
    pool.close()


async def test_a_replica_that_breaks_mid_delivery_fails_it(server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    pieces: list[bytes] = []
    with pytest.raises(UpstreamError, match="closed the connection"):
        await asyncio.wait_for(response.deliver(lambda data, last: pieces.append(data)), 5)
    assert pieces == [b"only part"]
    response.release()
    pool.close()


async def test_a_send_started_at_once_that_must_wait_finishes_in_order(
        server: RawServer) -> None:
    """As the gateway relays: each piece's send is started from the socket's callback; a
    client's write buffer full (uvicorn's send waiting to drain) holds the rest back."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for number in range(30):
            writer.write(b"3\r\n%03d\r\n" % number)
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server.handler = handler
    written: list[bytes] = []
    drained = asyncio.Event()
    drained.set()

    async def send(data: bytes) -> None:  # uvicorn's: waits while the client is full
        await drained.wait()
        written.append(data)
        if len(written) == 3:
            drained.clear()

    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    delivering = asyncio.ensure_future(response.deliver(lambda data, last: start(send(data))))
    await until(lambda: response._connection.paused, "reading to pause for the client")
    drained.set()
    await asyncio.wait_for(delivering, 5)
    assert b"".join(written) == b"".join(b"%03d" % n for n in range(30))
    response.release()
    pool.close()


async def test_a_delivery_cancelled_while_a_send_waits_ends_that_send(
        server: RawServer) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read()

    server.handler = handler
    never = asyncio.Event()
    ended: list[str] = []

    async def send(data: bytes) -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    delivering = asyncio.ensure_future(response.deliver(lambda data, last: start(send(data))))
    await until(lambda: response._connection.paused, "the send to wait")
    delivering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await delivering
    assert ended == ["cancelled"]
    response.close()
    pool.close()
