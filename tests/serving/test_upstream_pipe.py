"""A stream's chunks through a Pipe (serving/upstream/pipe.py) against real sockets: the
raw server of test_upstream.py sends each piece as its own read, and the test sees which
went through the pipe as they came and which reached the sink parsed."""

from __future__ import annotations

import asyncio

import pytest

from serving.upstream import ConnectionPool, Pipe, UpstreamError
from serving.upstream.pipe import NO_SIZE_LINE, PIPED_READ_MAX, SIZE_LINES
from tests.serving.test_upstream import RawServer, server  # noqa: F401 (the fixture)

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class Written:
    """A client's transport as the pipe sees it: what was written to it (each write lets
    the raw server send its next piece)."""

    def __init__(self, step: asyncio.Queue[None]) -> None:
        self.writes: list[bytes] = []
        self.step = step

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.step.put_nowait(None)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


HEX_DIGITS = b"0123456789abcdefABCDEF"
SIZE_LINE = 18  # bytes a chunk's size line may take: 16 hex digits and CRLF


def one_chunk(data: bytes) -> bool:
    """Whether `data` is exactly one whole chunk, not the last: a size line of plain hex
    digits (no extension), that many bytes, CRLF (what SIZE_LINES is checked against)."""
    line_end = data.find(b"\r\n", 0, SIZE_LINE)
    if line_end <= 0:
        return False
    size_line = data[:line_end]
    if size_line.strip(HEX_DIGITS):  # not only hex digits
        return False
    size = int(size_line, 16)
    return size > 0 and len(data) == line_end + 4 + size and data.endswith(b"\r\n")


class Script:
    """What the raw server sends for each request on a connection: the head, then each
    piece once the one before it was taken (piped or sunk)."""

    def __init__(self, raw: RawServer) -> None:
        self.pieces: list[bytes] = []
        self.step: asyncio.Queue[None] = asyncio.Queue()
        raw.handler = self.handler
        self.server = raw

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        while True:
            await self.server.read_request(reader)
            writer.write(HEAD)
            await writer.drain()
            for piece in self.pieces:
                await self.step.get()
                writer.write(piece)
                await writer.drain()


async def relay(script: Script, pool: ConnectionPool, pieces: list[bytes],
                opened: bool = True) -> tuple[Written, Pipe, list[bytes]]:
    """One request answered with `pieces`: what the pipe wrote, the pipe, what was sunk."""
    script.pieces = pieces
    response = await pool.request("POST", script.server.url, "/v1/completions", b"{}")
    pipe = Pipe(ending=b"\n\n", refused=b'"choices":[]', counted=b"data: {")
    written = Written(script.step)
    pipe.transport = written  # type: ignore[assignment]
    pipe.open = opened
    sunk: list[bytes] = []

    def sink(data: bytes, last: bool) -> None:  # holds a cut event back, as the relay
        sunk.append(data)
        pipe.behind = not data.endswith(b"\n\n")
        script.step.put_nowait(None)

    script.step.put_nowait(None)  # the first piece
    await asyncio.wait_for(response.deliver(sink, pipe), 5)
    response.release()
    return written, pipe, sunk


async def test_whole_chunks_go_through_the_pipe_as_they_came_the_rest_parsed_to_the_sink(
        server: RawServer) -> None:  # noqa: F811
    event = b'data: {"choices":[{"text":"a"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
    pieces = [chunk(event), chunk(event + event), chunk(usage), chunk(event),
              chunk(b"data: {\"cut"), chunk(b'"}\n\n'), chunk(event), b"0\r\n\r\n"]
    pool, script = ConnectionPool(), Script(server)
    written, pipe, sunk = await relay(script, pool, pieces)
    # Whole chunks of complete events went as they came, framing and all; the usage
    # event and an event cut across chunks (both its parts: the sink held the first
    # back) went to the sink, parsed; the end to the parser.
    assert written.writes == [chunk(event), chunk(event + event), chunk(event), chunk(event)]
    assert sunk == [usage, b"data: {\"cut", b'"}\n\n']
    assert pipe.take_counts()[:2] == (4, 5)  # four chunks, five events
    assert pipe.take_counts()[:2] == (0, 0)  # taken: counted again from nought
    # The answer ended as the parser saw it: the connection is kept for the next request.
    written, _, sunk = await relay(script, pool, [chunk(event), b"0\r\n\r\n"])
    assert written.writes == [chunk(event)] and server.connections == 1
    pool.close()


async def test_after_a_read_the_pipe_may_not_take_the_next_whole_chunk_goes_through_it(
        server: RawServer) -> None:  # noqa: F811
    event = b'data: {"choices":[{"text":"a"}]}\n\n'
    pool, script = ConnectionPool(), Script(server)
    # A chunk extension, a chunk cut across reads, two chunks in one read (a replica
    # faster than the gateway reads): the parser reads them, and the parser's own chunk
    # callbacks say where it stands, so the next whole chunk is piped again.
    for odd, events in (([b"%x;name=value\r\n%b\r\n" % (len(event), event)], 1),
                        ([chunk(event)[:10], chunk(event)[10:]], 1),
                        ([chunk(event)[:10], chunk(event)[10:] + chunk(event)[:7],
                          chunk(event)[7:]], 2),
                        ([chunk(event) + chunk(event)], 2)):
        written, _, sunk = await relay(script, pool, [chunk(event), *odd, chunk(event),
                                                         chunk(event), b"0\r\n\r\n"])
        assert written.writes == [chunk(event)] * 3, odd
        assert b"".join(sunk) == event * events, odd
    # A closed pipe takes nothing.
    written, _, sunk = await relay(script, pool, [chunk(event), b"0\r\n\r\n"], opened=False)
    assert written.writes == [] and b"".join(sunk) == event
    pool.close()


@pytest.mark.parametrize("size_line", [b"0x29", b"+29", b" 29", b"2_9", b"29 "])
async def test_a_malformed_chunk_is_never_piped_and_fails_the_answer(
        server: RawServer, size_line: bytes) -> None:  # noqa: F811
    event = b'data: {"choices":[{"text":"abcdefgh"}]}\n\n'
    assert len(event) == 0x29
    assert not one_chunk(size_line + b"\r\n" + event + b"\r\n")
    pool, script = ConnectionPool(), Script(server)
    with pytest.raises(UpstreamError, match="malformed answer"):
        await relay(script, pool, [size_line + b"\r\n" + event + b"\r\n", b"0\r\n\r\n"])
    pool.close()


async def test_a_size_line_written_otherwise_or_a_long_read_is_parsed_not_piped(
        server: RawServer) -> None:  # noqa: F811
    # The pipe knows a chunk's size line by the read's length (SIZE_LINES), as servers
    # write it: lower-case hex, no leading zero. Any other spelling, and a read longer
    # than PIPED_READ_MAX, is the parser's, and the event still reaches the client.
    event = b'data: {"choices":[{"text":"abcdefghi"}]}\n\n'
    assert len(event) == 0x2A
    long_event = b'data: {"choices":[{"text":"' + b"x" * PIPED_READ_MAX + b'"}]}\n\n'
    pool, script = ConnectionPool(), Script(server)
    for odd in (b"2A\r\n" + event + b"\r\n", b"02a\r\n" + event + b"\r\n",
                chunk(long_event)):
        written, _, sunk = await relay(script, pool, [chunk(event), odd, chunk(event),
                                                         b"0\r\n\r\n"])
        assert written.writes == [chunk(event), chunk(event)]
        assert b"".join(sunk) == (long_event if odd == chunk(long_event) else event)
    pool.close()


def test_each_size_line_is_the_only_one_a_whole_chunk_of_that_length_has() -> None:
    for length, line in enumerate(SIZE_LINES):
        if line == NO_SIZE_LINE:
            continue
        size = int(line, 16)
        whole = line + b"x" * size + b"\r\n"
        assert len(whole) == length and one_chunk(whole) and line == b"%x\r\n" % size
    # Lengths no chunk has: between one hex digit's and two's, two's and three's.
    assert SIZE_LINES[21] == SIZE_LINES[262] == NO_SIZE_LINE
    assert SIZE_LINES[6] == b"1\r\n" and SIZE_LINES[22] == b"10\r\n"


def test_one_chunk_is_exactly_one_whole_chunk_that_is_not_the_last() -> None:
    assert one_chunk(b"3\r\nabc\r\n")
    assert one_chunk(b"A\r\n0123456789\r\n")
    assert not one_chunk(b"0\r\n\r\n")  # the last chunk
    assert not one_chunk(b"3\r\nabc\r\n3\r\ndef\r\n")  # two
    assert not one_chunk(b"3\r\nab")  # cut short
    assert not one_chunk(b"3\r\nabcd\r\n")  # longer than it says
    assert not one_chunk(b"3;x\r\nabc\r\n")  # an extension
    assert not one_chunk(b"1" * 17 + b"\r\nabc\r\n")  # a size past 16 hex digits
