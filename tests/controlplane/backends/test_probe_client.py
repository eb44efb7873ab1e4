"""The probe client (controlplane/backends/probe_client.py) against endpoints that
misbehave on purpose, each a raw socket server here: connections kept and closed between
probes, answers that drip, run long, are chunked or malformed."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from controlplane.backends.probe_client import MAX_ANSWER_BYTES, ProbeClient, ProbeFailed
from tests.processes import wait_until

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
# The path every probe here asks for. A connection whose request asks for another is not
# this test's (a process or thread left from an earlier test, probing an endpoint that
# had the same port): it is neither counted nor answered.
PATH = "/probe-client-test"


class RawEndpoint:
    """Accepts connections and hands each to `serve` on a thread of its own; counts
    the connections and requests that ask for PATH."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.serve = serve
        self.requests = 0
        self.open: list[socket.socket] = []  # every connection accepted
        self.ours: list[socket.socket] = []  # those that asked for PATH
        threading.Thread(target=self.accept, daemon=True).start()

    @property
    def connections(self) -> int:
        return len(self.ours)

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.open.append(connection)
            threading.Thread(target=self.serve, args=(connection,), daemon=True).start()

    def read_request(self, connection: socket.socket) -> bool:
        """One request's head read; False when the client closed the connection or
        asked for another path than PATH."""
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                chunk = connection.recv(4096)
            except OSError:
                return False
            if not chunk:
                return False
            data += chunk
        if data.split(b" ", 2)[1:2] != [PATH.encode()]:
            return False
        if connection not in self.ours:
            self.ours.append(connection)
        self.requests += 1
        return True

    def close(self) -> None:
        self.listener.close()
        for connection in self.open:
            connection.close()


@contextmanager
def raw_endpoint(serve: Callable[[RawEndpoint, socket.socket], None]) -> Iterator[RawEndpoint]:
    holder: list[RawEndpoint] = []
    endpoint = RawEndpoint(lambda connection: serve(holder[0], connection))
    holder.append(endpoint)
    try:
        yield endpoint
    finally:
        endpoint.close()


def keep_alive(endpoint: RawEndpoint, connection: socket.socket) -> None:
    """Answers every request on the connection, as long as the client keeps it."""
    while endpoint.read_request(connection):
        connection.sendall(OK)


def test_a_kept_connection_serves_the_next_probes_and_one_closed_meanwhile_is_replaced(
        ) -> None:
    closing = threading.Event()

    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        while endpoint.read_request(connection):
            # Decided on reading the request, before answering it: looked at after the
            # answer, `closing` could already be set for the answer the client had
            # before the test set it (the third), and the kept connection would close
            # one probe early.
            last = closing.is_set()  # as a server whose keep-alive ran out between probes
            connection.sendall(OK)
            if last:
                connection.close()
                return

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        assert [client.status(endpoint.url, PATH) for _ in range(3)] == [200] * 3
        assert endpoint.connections == 1  # one connection for the three probes
        closing.set()
        assert client.status(endpoint.url, PATH) == 200
        wait_until("the endpoint closed the kept connection",
                   lambda: endpoint.ours[0].fileno() == -1, 5, 0.02)
        # The next probe finds it closed, opens another and is answered: no failed probe.
        assert client.status(endpoint.url, PATH) == 200
        assert endpoint.connections == 2 and endpoint.requests == 5
    client.close()


def test_an_endpoint_that_closes_a_kept_connection_as_the_probe_is_sent_is_asked_again(
        ) -> None:
    """The race a readability check cannot see: the request reaches a connection the
    endpoint is closing. Nothing of an answer came, so a new connection asks again."""

    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        """Each connection answers its first request and closes at its second."""
        if endpoint.read_request(connection):
            connection.sendall(OK)
        if endpoint.read_request(connection):
            connection.close()

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        assert client.status(endpoint.url, PATH) == 200
        assert client.status(endpoint.url, PATH) == 200
        assert endpoint.connections == 2 and endpoint.requests == 3
    client.close()


def test_an_answer_that_drips_fails_as_timed_out_within_the_probes_own_timeout() -> None:
    """A byte of the head every 50 ms, for ever: each read is answered well within the
    timeout, the probe as a whole is not."""

    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        endpoint.read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\n")
        try:
            while True:
                connection.sendall(b"x")
                time.sleep(0.05)
        except OSError:
            return

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        started = time.monotonic()
        with pytest.raises(ProbeFailed) as failed:
            client.status(endpoint.url, PATH, timeout=0.5)
        assert failed.value.kind == "Timeout"
        assert 0.45 < time.monotonic() - started < 1.5


def test_chunked_and_oversized_answers_give_their_status_and_only_a_whole_one_is_kept(
        ) -> None:
    bodies = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % (
            MAX_ANSWER_BYTES * 2) + b"x" * (MAX_ANSWER_BYTES * 2),
        OK,
    ]

    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        try:
            while endpoint.read_request(connection):
                connection.sendall(bodies.pop(0))
        except OSError:
            return  # the client closed the connection mid-body

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        assert client.status(endpoint.url, PATH) == 200  # chunked, kept
        assert client.status(endpoint.url, PATH) == 503  # too long to read: closed
        assert client.status(endpoint.url, PATH) == 200
        assert endpoint.connections == 2
    client.close()


def test_an_answer_head_that_never_ends_fails_the_probe_after_a_bounded_read() -> None:
    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        endpoint.read_request(connection)
        try:
            connection.sendall(b"HTTP/1.1 200 OK\r\nX-Long: ")
            while True:
                connection.sendall(b"a" * 65536)
        except OSError:
            return

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        with pytest.raises(ProbeFailed) as endless:
            client.status(endpoint.url, PATH)
        assert endless.value.kind == "ProtocolError"
        assert "head" in str(endless.value)


def test_a_tls_handshake_is_bounded_by_the_timeout_with_descriptors_past_1024() -> None:
    """A process watching a fleet holds more than select's 1,024 descriptors: a
    handshake nobody answers still times out, and one answered in plain HTTP fails."""
    spare: list[int] = []
    while not spare or spare[-1] < 1100:
        spare.append(os.dup(0))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        client = ProbeClient()
        started = time.monotonic()
        with pytest.raises(ProbeFailed) as timed_out:
            client.status(f"https://127.0.0.1:{silent.getsockname()[1]}", PATH,
                          timeout=0.5)
        assert timed_out.value.kind == "Timeout"
        assert 0.45 < time.monotonic() - started < 1.5

        def plain(endpoint: RawEndpoint, connection: socket.socket) -> None:
            connection.recv(4096)
            connection.sendall(OK)

        with raw_endpoint(plain) as endpoint:
            with pytest.raises(ProbeFailed) as not_tls:
                client.status(endpoint.url.replace("http:", "https:"), PATH)
            assert not_tls.value.kind == "ConnectError"
    finally:
        silent.close()
        for descriptor in spare:
            os.close(descriptor)


def test_a_malformed_answer_or_a_header_with_a_line_break_is_a_protocol_error() -> None:
    def serve(endpoint: RawEndpoint, connection: socket.socket) -> None:
        if endpoint.read_request(connection):
            connection.sendall(b"this is not HTTP\r\n\r\n")

    client = ProbeClient()
    with raw_endpoint(serve) as endpoint:
        with pytest.raises(ProbeFailed) as malformed:
            client.status(endpoint.url, PATH)
        assert malformed.value.kind == "ProtocolError"
        with pytest.raises(ProbeFailed) as injected:
            client.status(endpoint.url, PATH,
                          (("Authorization", "Bearer k\r\nX-Other: 1"),))
        assert injected.value.kind == "ProtocolError"
        assert endpoint.requests == 1  # the second was never sent
    with pytest.raises(ProbeFailed) as not_http:
        client.status("ftp://127.0.0.1:1", PATH)
    assert not_http.value.kind == "ProtocolError"


def test_probes_run_on_the_calling_thread_and_start_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    caller = threading.current_thread()
    started: list[str] = []
    start = threading.Thread.start

    def recorded(thread: threading.Thread) -> None:
        if threading.current_thread() is caller:
            started.append(thread.name)
        start(thread)

    with raw_endpoint(keep_alive) as endpoint:
        monkeypatch.setattr(threading.Thread, "start", recorded)
        client = ProbeClient()
        assert [client.status(endpoint.url, PATH) for _ in range(2)] == [200, 200]
        monkeypatch.undo()
        assert started == []
    client.close()


def test_a_probe_leaves_no_garbage_for_the_cycle_collector() -> None:
    """A probe's parser and the callbacks it calls are freed as the probe ends, kept
    connection or not, answered or failed: a fleet's probes, a few hundred a second at a
    thousand deployments, leave nothing for the cycle collector to find and scan."""
    import httptools

    from controlplane.backends import probe_client

    def malformed(endpoint: RawEndpoint, connection: socket.socket) -> None:
        if endpoint.read_request(connection):
            connection.sendall(b"this is not HTTP\r\n\r\n")

    client = ProbeClient()
    with raw_endpoint(keep_alive) as kept, raw_endpoint(malformed) as broken:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept to be looked at
        try:
            assert [client.status(kept.url, PATH) for _ in range(3)] == [200] * 3
            with pytest.raises(ProbeFailed):
                client.status(broken.url, PATH)
            gc.collect()
            left = [thing for thing in gc.garbage
                    if isinstance(thing, (probe_client._Answer, httptools.HttpResponseParser))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert left == []
    client.close()


def test_a_name_the_resolver_does_not_answer_fails_the_probe_within_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The system's resolver cannot be interrupted: a name it sits on fails the probe
    as timed out when the probe's time is up, the lookup left on a resolver thread."""
    answering = threading.Event()
    resolve = socket.getaddrinfo

    def stuck(host: str, *args: Any, **options: Any) -> Any:
        if host == "stuck.example":
            answering.wait(10)  # as a resolver whose servers do not answer
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return resolve(host, *args, **options)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    client = ProbeClient()
    try:
        started = time.monotonic()
        with pytest.raises(ProbeFailed) as timed_out:
            client.status("http://stuck.example:8000", PATH, timeout=0.5)
        assert timed_out.value.kind == "Timeout"
        assert "stuck.example not resolved within 0.5 s" in str(timed_out.value)
        assert 0.45 < time.monotonic() - started < 1.5
    finally:
        answering.set()
    client.close()


def test_a_name_is_resolved_and_each_of_its_addresses_tried_in_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A name whose first address refuses (a port nothing listens on) is reached at the
    next; a name that does not resolve fails as a connection error that says so."""
    refused = socket.create_server(("127.0.0.1", 0))
    nobody = refused.getsockname()[1]
    refused.close()
    with raw_endpoint(keep_alive) as endpoint:
        resolve = socket.getaddrinfo

        def two(host: str, *args: Any, **options: Any) -> Any:
            if host == "two.example":
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", nobody)),
                        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", endpoint.port))]
            if host == "none.example":
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return resolve(host, *args, **options)

        monkeypatch.setattr(socket, "getaddrinfo", two)
        client = ProbeClient()
        assert client.status("http://two.example:1", PATH) == 200
        assert endpoint.requests == 1
        with pytest.raises(ProbeFailed) as unknown:
            client.status("http://none.example:1", PATH)
        assert unknown.value.kind == "ConnectError"
        assert "Name or service not known" in str(unknown.value)
        client.close()
