"""A pipe for a streamed answer: its chunks written to the client as they came from the
replica, in the socket's callback that read them, with no parsing, buffering or framing
again (serving/upstream/connection.py decides, chunk by chunk, which go through it)."""

from __future__ import annotations

import asyncio

# The longest read that may be piped (an SSE event is some hundreds of bytes; a longer
# read is parsed).
PIPED_READ_MAX = 8192
NO_SIZE_LINE = b"\xff"  # no read that is a chunk starts so


def size_lines(limit: int) -> list[bytes]:
    """By the length of a read, the size line (with its CRLF) that read has if it is one
    whole chunk, not the last, written as servers write it (lower-case hex, no leading
    zero); NO_SIZE_LINE for a length no chunk has. A read of n bytes is such a chunk of s
    bytes for at most one s (n = the size line's length + s + 2: the lengths of the size
    lines of 1, 2, 3 ... hex digits give ranges of n that do not meet)."""
    lines = [NO_SIZE_LINE] * (limit + 1)
    for size in range(1, limit):
        line = b"%x\r\n" % size
        if len(line) + size + 2 <= limit:
            lines[len(line) + size + 2] = line
    return lines


SIZE_LINES = size_lines(PIPED_READ_MAX)


class Pipe:
    """Where a chunked answer's chunks may go as they came: a client's transport, with no
    parsing, buffering or framing again, each in the socket callback that read it. Its
    server opens it (`open`: the client's answer is started and chunked, its writing not
    paused, the client there); its owner says when it holds bytes back that the next
    chunk must follow (`behind`). A read goes through when it is one whole chunk, not the
    last, its size line as servers write it (SIZE_LINES: the one a read of its length
    would have), read while the parser is between chunks with nothing buffered or held
    before it, its data ending with `ending` and holding no `refused`; any other read
    (a chunk extension, an upper-case or zero-padded size, a read past PIPED_READ_MAX)
    reaches the Sink, parsed. Counted here, for the owner to take: the
    chunks, the `counted` found in them, the times of the first and the last
    (time.perf_counter)."""

    __slots__ = ("behind", "chunks", "counted", "ending", "first", "found", "last", "open",
                 "refused", "transport")

    def __init__(self, ending: bytes, refused: bytes, counted: bytes) -> None:
        self.ending = ending + b"\r\n"  # (with the chunk's own CRLF)
        self.refused, self.counted = refused, counted
        self.transport: asyncio.WriteTransport | None = None
        self.open = False  # the transport may be written to (its server says)
        self.behind = False  # its owner holds bytes back that the next chunk must follow
        self.chunks = self.found = 0
        self.first = self.last = 0.0

    def take_counts(self) -> tuple[int, int, float, float]:
        """The chunks piped since the last call, the `counted` in them, the first's and
        the last's times; the counts start again."""
        counts = self.chunks, self.found, self.first, self.last
        self.chunks = self.found = 0
        return counts

