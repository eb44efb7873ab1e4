"""The server's HTTP protocol (controlplane/http_protocol.py): an answer whole when it
starts reaches the client in one piece, head and body together; a stream's head is not
held back waiting for its first bytes; keep-alive, chunked bodies and a closing answer
still work; the callback a request asks for runs once when its client goes mid-answer.
Most of these run the server in a process of its own, as `manage.py serve` does, so the
client reads what each write of the server brought."""

from __future__ import annotations

import asyncio
import gc
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from controlplane.http_protocol import PIPE, WRITE_BODY, HttpProtocol
from serving.upstream import Pipe
from tests.processes import ROOT, free_port, wait_healthy

# The stream's body waits for a request to /go.
release: dict[str, asyncio.Event] = {}
# Whether /piped's pipe was open at each step (read back through /seen).
seen: dict[str, bool] = {}


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/whole (any other path too): a sized answer sent at once; /stream: a chunked one
    whose body waits for a request to /go; /written: a chunked one written through the
    scope's write_body; /close: a sized answer that ends the connection."""
    path = scope["path"]
    if path == "/piped":  # a chunk written through the pipe once the server opens it
        pipe = Pipe(ending=b"\n\n", refused=b"", counted=b"data: ")
        scope["extensions"][PIPE](pipe)
        seen["before the head"] = pipe.open
        sized = scope["query_string"] == b"sized"  # an answer with its length: not chunked
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]
                    + [(b"content-length", b"11")] * sized})
        seen["head held"] = pipe.open
        for _ in range(100):
            if pipe.open:
                break
            await asyncio.sleep(0)
        seen["head written"] = pipe.open
        if pipe.open:
            assert pipe.transport is not None
            pipe.transport.write(b"b\r\ndata: one\n\n\r\n")
            assert scope["extensions"][WRITE_BODY](b"data: two\n\n", False)
        else:
            await send({"type": "http.response.body", "body": b"data: one\n\n"})
        seen["ended"] = pipe.open
        return
    if path == "/seen":
        body = repr(sorted(seen.items())).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    if path == "/written":  # the chunks through the scope's write_body
        write_body = scope["extensions"][WRITE_BODY]
        early = write_body(b"too early", True)  # before the head: refused, nothing written
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"x-early", str(early).encode())]})
        assert write_body(b"data: one\n\n", True)
        assert write_body(b"data: two\n\n", False)
        return
    if path == "/stream":
        go = release["stream"] = asyncio.Event()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await go.wait()
        await send({"type": "http.response.body", "body": b"data: one\n\n",
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if path == "/go":
        release["stream"].set()
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"5")]
    if path == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


SERVER = """
import sys, uvicorn
from controlplane.http_protocol import HttpProtocol
from tests.controlplane.test_http_protocol import application
uvicorn.run(application, host="127.0.0.1", port=int(sys.argv[1]), http=HttpProtocol,
            lifespan="off", log_level="warning")
"""


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 30, process)
        yield port
    finally:
        process.kill()
        process.wait(timeout=10)


def ask(connection: socket.socket, path: str) -> bytes:
    """Send a GET; the bytes of the client's first read of the answer."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    return connection.recv(65536)


def read_until(connection: socket.socket, data: bytes, end: bytes) -> bytes:
    """More reads until `data` ends with `end`."""
    while not data.endswith(end):
        more = connection.recv(65536)
        assert more, data
        data += more
    return data


def test_a_whole_answer_arrives_in_one_read_head_and_body_together(server_port: int
                                                                      ) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        for _ in range(20):  # and again on the kept-alive connection
            first = ask(connection, "/whole")
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert first.endswith(b"\r\n\r\nhello")


def test_a_streams_head_comes_before_its_first_bytes_are_ready(server_port: int) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        head = read_until(connection, ask(connection, "/stream"), b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"transfer-encoding: chunked" in head
        with socket.create_connection(("127.0.0.1", server_port), timeout=10) as other:
            assert ask(other, "/go").endswith(b"hello")
        body = read_until(connection, b"", b"0\r\n\r\n")
        assert body == b"b\r\ndata: one\n\n\r\n0\r\n\r\n"
        assert ask(connection, "/whole").endswith(b"\r\n\r\nhello")  # still kept alive


def test_a_stream_written_through_the_scopes_write_body_is_well_formed(server_port: int
                                                                         ) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        answer = read_until(connection, ask(connection, "/written"), b"0\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"x-early: False" in head
        assert body == b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
        assert ask(connection, "/whole").endswith(b"\r\n\r\nhello")  # still kept alive


def test_a_pipe_opens_once_the_head_is_written_and_closes_when_the_answer_ends(
        server_port: int) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        answer = read_until(connection, ask(connection, "/piped"), b"0\r\n\r\n")
        # The chunk written through the pipe, then the last through write_body, in order.
        assert answer.partition(b"\r\n\r\n")[2] == (
            b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n")
        states = ask(connection, "/seen").partition(b"\r\n\r\n")[2]
        assert states == repr(sorted({"before the head": False, "head held": False,
                                      "head written": True, "ended": False}.items())
                              ).encode()


def test_no_pipe_opens_onto_an_answer_that_is_not_chunked(server_port: int) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        answer = read_until(connection, ask(connection, "/piped?sized"), b"data: one\n\n")
        assert b"content-length: 11" in answer and b"chunked" not in answer
        states = ask(connection, "/seen").partition(b"\r\n\r\n")[2]
    assert states == repr(sorted({"before the head": False, "head held": False,
                                  "head written": False, "ended": False}.items())).encode()


def test_the_gateway_looks_for_write_body_under_the_name_the_server_gives_it() -> None:
    from controlplane import http_protocol
    from serving.gateway.call import PIPE, WRITE_BODY

    assert WRITE_BODY == http_protocol.WRITE_BODY
    assert PIPE == http_protocol.PIPE


def test_an_answer_that_closes_the_connection_is_written_whole_first(server_port: int
                                                                      ) -> None:
    with socket.create_connection(("127.0.0.1", server_port), timeout=10) as connection:
        answer = read_until(connection, ask(connection, "/close"), b"hello")
        assert b"connection: close" in answer
        assert connection.recv(65536) == b""  # then the server closed it


async def test_a_finished_request_leaves_no_garbage_for_the_cycle_collector() -> None:
    # A request's objects (its cycle, the transport view writing its answer, its scope)
    # are freed as it ends, by reference counting: left as reference cycles they would
    # wait for the cycle collector, which then scans them again and again.
    import uvicorn

    config = uvicorn.Config(application, host="127.0.0.1", port=free_port(),
                            http=HttpProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept to be looked at
        try:
            for path, end in (("/whole", b"hello"), ("/written", b"0\r\n\r\n"),
                              ("/close", b"hello")):
                reader, writer = await asyncio.open_connection("127.0.0.1", config.port)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
                answer = b""
                while not answer.endswith(end):
                    more = await asyncio.wait_for(reader.read(65536), 10)
                    assert more, answer
                    answer += more
                writer.close()
                await writer.wait_closed()
            while server.server_state.connections or server.server_state.tasks:
                await asyncio.sleep(0.01)  # the server saw each client go
            gc.collect()
            left = sorted({type(thing).__name__ for thing in gc.garbage
                           if type(thing).__module__.startswith(("uvicorn", "controlplane"))})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert left == []
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


async def test_the_server_calls_back_once_when_a_client_leaves_mid_answer() -> None:
    # The gateway hears this way that a streaming client has gone (no task per stream
    # waiting on `receive`): once, for an answer not yet complete; not after the callback
    # is taken back; at once for one asked after the client went.
    import uvicorn

    from controlplane.http_protocol import WHEN_LOST

    called: list[str] = []
    finish = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, when_lost = scope["path"], scope["extensions"][WHEN_LOST]
        if path == "/late":  # asked only once the client has gone
            while (await receive())["type"] != "http.disconnect":
                continue
        when_lost(lambda: called.append(path))
        if path == "/taken-back":
            when_lost(None)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await finish.wait()

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), http=HttpProtocol,
                            lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        for path in ("/watched", "/taken-back", "/late"):
            reader, writer = await asyncio.open_connection("127.0.0.1", config.port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
            if path != "/late":
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200 OK")  # the callback is asked for
            writer.close()
            await writer.wait_closed()
            deadline = asyncio.get_running_loop().time() + 10
            while server.server_state.connections:  # the server saw the client go
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
        deadline = asyncio.get_running_loop().time() + 10
        while len(called) < 2:
            assert asyncio.get_running_loop().time() < deadline, called
            await asyncio.sleep(0.01)
        assert called == ["/watched", "/late"]
    finally:
        finish.set()
        server.should_exit = True
        await serving


def test_the_gateway_looks_for_when_lost_under_the_name_the_server_gives_it() -> None:
    from controlplane import http_protocol
    from serving.gateway.call import WHEN_LOST

    assert WHEN_LOST == http_protocol.WHEN_LOST
