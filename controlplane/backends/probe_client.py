"""Health probes of endpoints: one GET each, on the probing thread itself (one of the
reconciler's probe threads), over blocking sockets kept per endpoint between probes.

A probe thread waits for its probe's answer anyway, so the probe runs there: no event
loop of its own, no hand-over to one and back (an earlier client ran the probes on an
event-loop thread: each probe woke two threads more, and the loop woke again to see the
endpoint close the idle connection; `bench/gateway_overhead.py --compare-with` measured
the probes' share of the gateway's CPU per event). A general client's pool does not scale
to a fleet's endpoints either (httpx's looks at every connection it holds on every
request); this one looks up its connections by endpoint (host, port, TLS).

Each probe is bounded by its timeout from its start to its end: resolving the host's name,
connecting (to each of its addresses in turn), the TLS handshake, sending, and every read
wait for what is left of it. A name is resolved on a thread of a small pool of its own
(the system's resolver cannot be interrupted): one the resolver does not answer in time
fails the probe as timed out and holds that thread until the resolver gives up, not the
probe thread; an IP address is used as it is. The answer is parsed by the C parser the
gateway uses (httptools); its body is read so the connection can serve the next probe, up
to MAX_ANSWER_BYTES in all (the rest of a longer one is not read: the status is known, the
connection is closed; a head not ended by then fails the probe)."""

from __future__ import annotations

import ipaddress
import select
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import httptools

from serving.upstream import Target, UpstreamError, request_bytes, target

# The most of an answer read (to keep the connection for the next probe); past it the
# connection closes, and an answer whose head has not ended by then fails.
MAX_ANSWER_BYTES = 1 << 20
# Connections kept per endpoint (probes of one endpoint are one at a time: `probe_key`).
IDLE_PER_ENDPOINT = 2
# A connection kept this long without a probe is closed (by the next probe of any
# endpoint): an endpoint that left the fleet leaves no socket behind for long.
IDLE_SECONDS = 60.0
READ_SIZE = 65536

Endpoint = tuple[str, int, bool]


class ProbeFailed(Exception):
    """The endpoint did not answer: `kind` names how (ConnectError, Timeout, ...)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class _ClosedFirst(Exception):
    """A kept connection ended before any byte of the answer: nothing reached the
    endpoint's application, so a new connection may send again."""


class _Answer:
    """The parser's callbacks for one answer."""

    def __init__(self) -> None:
        self.head = False
        self.complete = False
        self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_headers_complete(self) -> None:
        self.head = True

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: the parser forgets it once the message is over.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()


class ProbeClient:
    """GETs to endpoints from any thread, each bounded by its own timeout."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Connections kept alive per endpoint, with when each was last used.
        self.idle: dict[Endpoint, list[tuple[socket.socket, float]]] = {}
        self.swept = time.monotonic()
        self._tls: ssl.SSLContext | None = None

    def tls_context(self) -> ssl.SSLContext:
        """One context for every endpoint (building one reads the system's CAs)."""
        with self.lock:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            return self._tls

    def status(self, base_url: str, path: str, headers: tuple[tuple[str, str], ...] = (),
               timeout: float = 5.0) -> int:
        """The HTTP status of GET `base_url` + `path`; ProbeFailed when none came."""
        deadline = time.monotonic() + timeout
        try:
            where = target(base_url)
            request = request_bytes("GET", where, path, headers=headers)
        except UpstreamError as exc:
            raise ProbeFailed("ProtocolError", str(exc)) from None
        endpoint = (where.host, where.port, where.tls)
        kept = self.take_idle(endpoint)
        if kept is not None:
            try:
                return self.exchange(kept, endpoint, request, deadline, timeout)
            except _ClosedFirst:
                pass  # closed by the endpoint meanwhile: a new connection sends again
        sock = self.connect(where, deadline, timeout)
        try:
            return self.exchange(sock, endpoint, request, deadline, timeout)
        except _ClosedFirst:
            raise ProbeFailed("ProtocolError", "the endpoint closed the connection without "
                                               "an answer") from None

    def connect(self, where: Target, deadline: float, timeout: float) -> socket.socket:
        """A new connection, TLS negotiated where the URL says https."""
        place = f"{where.host}:{where.port}"
        try:
            sock = _connect(_addresses(where.host, where.port, deadline, timeout),
                            deadline, timeout)
        except _NotResolved:
            raise ProbeFailed("Timeout", f"{where.host} not resolved within "
                                         f"{timeout:g} s") from None
        except TimeoutError:
            raise ProbeFailed("Timeout", f"no connection to {place} within "
                                         f"{timeout:g} s") from None
        except OSError as exc:
            raise ProbeFailed("ConnectError", f"cannot connect to {place}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if where.tls:
                sock = self.handshake(sock, where.host, deadline, timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def handshake(self, sock: socket.socket, host: str, deadline: float,
                  timeout: float) -> ssl.SSLSocket:
        """The TLS handshake, its waits bounded by what is left of the probe's time."""
        secure = self.tls_context().wrap_socket(sock, server_hostname=host,
                                                do_handshake_on_connect=False)
        secure.setblocking(False)
        try:
            while True:
                try:
                    secure.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    ready = _ready(secure, select.POLLIN, _left(deadline, timeout))
                except ssl.SSLWantWriteError:
                    ready = _ready(secure, select.POLLOUT, _left(deadline, timeout))
                if not ready:
                    raise TimeoutError
        except TimeoutError:
            raise ProbeFailed("Timeout", f"no TLS handshake with {host} within "
                                         f"{timeout:g} s") from None
        except (ssl.SSLError, OSError) as exc:
            raise ProbeFailed("ConnectError", f"TLS with {host} failed: {exc}") from None
        secure.setblocking(True)
        return secure

    def exchange(self, sock: socket.socket, endpoint: Endpoint, request: bytes,
                 deadline: float, timeout: float) -> int:
        """Send the request, read the answer; the connection is kept for the next probe
        when the answer was whole and the endpoint keeps it alive, else closed."""
        answer = _Answer()
        parser = answer.parser = httptools.HttpResponseParser(answer)
        received = False
        keep = False
        try:
            sock.settimeout(_left(deadline, timeout))
            sock.sendall(request)
            read = 0
            while not answer.complete and read <= MAX_ANSWER_BYTES:
                sock.settimeout(_left(deadline, timeout))
                data = sock.recv(READ_SIZE)
                read += len(data)
                if not data:
                    if not received:
                        raise _ClosedFirst
                    if not answer.head:
                        raise ProbeFailed("ProtocolError", "the endpoint closed the "
                                                           "connection mid-answer")
                    break  # a body delimited by the connection's end: the status came
                received = True
                parser.feed_data(data)
            if not answer.head:  # a head that never ends
                raise ProbeFailed("ProtocolError", f"no end to the answer's head in its "
                                                   f"first {MAX_ANSWER_BYTES} bytes")
            keep = answer.complete and answer.keep_alive
            return parser.get_status_code()
        except TimeoutError:
            raise ProbeFailed("Timeout", f"no answer within {timeout:g} s") from None
        except httptools.HttpParserError as exc:
            if answer.head:  # the status came; what follows it is not this probe's concern
                return parser.get_status_code()
            raise ProbeFailed("ProtocolError", f"malformed answer: {exc}") from None
        except OSError as exc:
            if not received:
                raise _ClosedFirst from None
            raise ProbeFailed("ProtocolError", f"the connection failed: {exc}") from None
        finally:
            # The parser holds the answer (its callbacks) and the answer the parser: let
            # go of one, so both are freed now, not left for the cycle collector.
            answer.parser = None
            if keep:
                self.put_back(endpoint, sock)
            else:
                sock.close()

    def take_idle(self, endpoint: Endpoint) -> socket.socket | None:
        """A kept connection to the endpoint still open, the most recent first (one the
        endpoint closed, or wrote to unasked, is readable: it is closed instead)."""
        while True:
            with self.lock:
                kept = self.idle.get(endpoint)
                if not kept:
                    return None
                sock, _ = kept.pop()
            try:
                readable = _ready(sock, select.POLLIN, 0.0)
            except (OSError, ValueError):
                readable = True
            if not readable:
                return sock
            sock.close()

    def put_back(self, endpoint: Endpoint, sock: socket.socket) -> None:
        now = time.monotonic()
        closing: list[socket.socket] = []
        with self.lock:
            kept = self.idle.setdefault(endpoint, [])
            kept.append((sock, now))
            if len(kept) > IDLE_PER_ENDPOINT:
                closing.append(kept.pop(0)[0])
            if now - self.swept > IDLE_SECONDS:  # at most once a minute: every endpoint
                self.swept = now
                for other, others in list(self.idle.items()):
                    fresh = [(s, used) for s, used in others if now - used <= IDLE_SECONDS]
                    closing += [s for s, used in others if now - used > IDLE_SECONDS]
                    if fresh:
                        self.idle[other] = fresh
                    else:
                        del self.idle[other]
        for old in closing:
            old.close()

    def close(self) -> None:
        """Close every kept connection."""
        with self.lock:
            kept, self.idle = self.idle, {}
        for connections in kept.values():
            for sock, _ in connections:
                sock.close()


class _NotResolved(Exception):
    """The resolver did not answer within the probe's time."""


# What socket.getaddrinfo gives for each address: family, type, protocol, name, address.
Address = tuple[Any, Any, int, str, Any]
# Threads that resolve host names: a resolver that hangs holds one of them until it gives
# up (its own timeouts, seconds), never a probe past its timeout.
_resolvers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe-resolve")


def _addresses(host: str, port: int, deadline: float, timeout: float) -> list[Address]:
    """The addresses to connect to: an IP address as it is; a name resolved on a resolver
    thread, waited for at most what is left of the probe's time (else _NotResolved)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass  # a name, not an address
    else:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0,
                                  socket.AI_NUMERICHOST)
    lookup = _resolvers.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        return lookup.result(timeout=_left(deadline, timeout))
    except (TimeoutError, FutureTimeout):
        lookup.cancel()  # not started yet: never started
        raise _NotResolved from None


def _connect(addresses: list[Address], deadline: float, timeout: float) -> socket.socket:
    """A connection to the first of `addresses` that takes one, each try waiting at most
    what is left of the probe's time; the last failure if none does."""
    failure: OSError = OSError("no address")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_left(deadline, timeout))
            sock.connect(address)
            return sock
        except TimeoutError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            failure = exc
    raise failure


def _ready(sock: socket.socket, events: int, wait: float) -> bool:
    """Whether the socket is ready for `events` within `wait` seconds (poll, not select:
    a process holding a fleet's connections has descriptors past select's 1,024)."""
    poller = select.poll()
    poller.register(sock, events)
    return bool(poller.poll(wait * 1000.0))


def _left(deadline: float, timeout: float) -> float:
    """What is left of a probe's time; TimeoutError once none is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"past {timeout:g} s")
    return left


_client: ProbeClient | None = None
_lock = threading.Lock()


def shared() -> ProbeClient:
    """The process's probe client, made on first use."""
    global _client
    with _lock:
        if _client is None:
            _client = ProbeClient()
        return _client
