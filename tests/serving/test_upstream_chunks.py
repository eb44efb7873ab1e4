"""A replica's own chunks handed on unparsed (Response.deliver's chunk sink), against real
sockets: the raw server of test_upstream.py writes each piece as its own read, so the
reads that are whole chunks and the ones that are not (a chunk cut in two, a chunk
extension, the last chunk) are each made on purpose; whatever way a byte goes, the
caller gets every byte once and in order."""

from __future__ import annotations

import asyncio

import pytest

from serving.upstream import ConnectionPool
from serving.upstream.connection import MOST_CHUNKS, whole_chunks
from tests.serving.test_upstream import RawServer, server  # noqa: F401 (a fixture)

HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def unchunked(framed: bytes) -> bytes:
    """The data of whole chunks, framing taken off."""
    out, at = b"", 0
    while at < len(framed):
        line = framed.index(b"\r\n", at)
        size = int(framed[at:line], 16)
        out += framed[line + 2:line + 2 + size]
        at = line + 4 + size
    return out


@pytest.mark.parametrize("data", [
    chunk(b"data: 1\n\n"),
    chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n"),
    b"A\r\n0123456789\r\n",  # upper-case hex
    chunk(b"x" * 300),
    chunk(b"a") * MOST_CHUNKS,
])
def test_whole_chunks_are_recognised(data: bytes) -> None:
    assert whole_chunks(data)


@pytest.mark.parametrize("data", [
    b"",
    chunk(b"data: 1\n\n")[:-1],  # its line end not all there
    chunk(b"data: 1\n\n")[:5],  # cut in its data
    b"9",  # cut in its size
    b"9;name=value\r\ndata: 1\n\n\r\n",  # an extension
    b"0x9\r\ndata: 1\n\n\r\n",  # not plain hex
    b"+9\r\ndata: 1\n\n\r\n",
    b" 9\r\ndata: 1\n\n\r\n",
    b"9 \r\ndata: 1\n\n\r\n",
    b"0\r\n\r\n",  # the last chunk: the parser must see the end
    chunk(b"data: 1\n\n") + b"0\r\n\r\n",
    b"\r\ndata: 1\n\n\r\n",  # no size
    b"000000009\r\ndata: 1\n\n\r\n",  # a size line longer than any replica writes
    chunk(b"data: 1\n\n") + b"garbage",
    chunk(b"a") * (MOST_CHUNKS + 1),  # cheaper through the parser
    b"data: 1\n\n",  # not chunked at all
])
def test_anything_else_is_not(data: bytes) -> None:
    assert not whole_chunks(data)


async def test_whole_chunks_between_chunks_go_unparsed_and_the_rest_is_parsed(
        server: RawServer) -> None:  # noqa: F811
    pieces = [
        HEAD + chunk(b"data: 1\n\n"),  # with the head: parsed
        chunk(b"data: 2\n\n"),  # whole, after a read ending a chunk: unparsed
        chunk(b"data: 3\n\n") + chunk(b"data: 4\n\n"),  # two at once: unparsed
        chunk(b"data: 5\n\n")[:5],  # a chunk cut in two: both halves parsed
        chunk(b"data: 5\n\n")[5:],
        b"9;x=y\r\ndata: 6\n\n\r\n",  # an extension: parsed
        chunk(b'data: {"usage"}\n\n'),  # declined by the chunk sink: parsed
        chunk(b"data: 7\n\n"),
    ]
    got: list[tuple[str, bytes]] = []
    arrived = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        for piece in pieces:
            arrived.clear()
            writer.write(piece)
            await writer.drain()
            await asyncio.wait_for(arrived.wait(), 5)  # each piece its own read
        writer.write(b"0\r\n\r\n")  # the end: parsed (the delivery ends)
        await server.read_request(reader)  # the next request, on the same connection
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    def sink(data: bytes, last: bool) -> None:
        got.append(("parsed", data))
        arrived.set()

    def chunk_sink(chunks: bytes) -> bool:
        if b"usage" in chunks:
            return False
        got.append(("unparsed", chunks))
        arrived.set()
        return True

    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    await asyncio.wait_for(response.deliver(sink, chunk_sink), 10)
    assert [(way, unchunked(data) if way == "unparsed" else data) for way, data in got] == [
        ("parsed", b"data: 1\n\n"),
        ("unparsed", b"data: 2\n\n"),
        ("unparsed", b"data: 3\n\ndata: 4\n\n"),
        ("parsed", b"da"),  # the first half's data (of "9\r\nda")
        ("parsed", b"ta: 5\n\n"),
        ("parsed", b"data: 6\n\n"),
        ("parsed", b'data: {"usage"}\n\n'),
        ("unparsed", b"data: 7\n\n"),
    ]
    assert got[1][1] == pieces[1]  # handed on framing and all
    response.release()
    # The parser knew where the answer ended: the connection is reused for the next one.
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    assert await response.read() == b"ok"
    response.release()
    assert server.connections == 1
    pool.close()


async def test_a_sized_stream_is_never_offered_as_chunks(server: RawServer) -> None:  # noqa: F811
    body = chunk(b"data: 1\n\n")  # looks like a chunk, but the body is sized

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (2 * len(body)))
        writer.write(body)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body)
        await writer.drain()
        await reader.read()

    parsed: list[bytes] = []
    server.handler = handler
    pool = ConnectionPool()
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")

    def refuse(chunks: bytes) -> bool:
        raise AssertionError("offered a sized body as chunks")

    await asyncio.wait_for(response.deliver(lambda data, last: parsed.append(data), refuse),
                           5)
    assert b"".join(parsed) == body * 2
    response.release()
    pool.close()
