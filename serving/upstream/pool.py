"""Keep-alive connection pools per replica, and replica base URLs parsed once."""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from serving.upstream.connection import Connection, Response, UpstreamError, UpstreamStalled

CONNECT_TIMEOUT = 5.0
IDLE_PER_HOST = 256


@dataclass(frozen=True)
class Target:
    """A replica's base URL, parsed: where to connect and what to send."""

    host: str
    port: int
    prefix: str
    tls: bool
    host_header: bytes


@functools.lru_cache(maxsize=4096)
def target(base_url: str) -> Target:
    """A replica's base URL, parsed once."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {base_url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    return Target(
        parts.hostname,
        port,
        parts.path.rstrip("/"),
        tls,
        (parts.netloc.rsplit("@", 1)[-1]).encode("idna"),
    )


def request_bytes(method: str, where: Target, path: str, body: bytes = b"",
                  headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """One HTTP/1.1 request to `where`, head and body; UpstreamError for a header value
    holding a line break."""
    lines = [
        f"{method} {where.prefix}{path} HTTP/1.1\r\n".encode("latin-1"),
        b"Host: ",
        where.host_header,
        b"\r\n",
    ]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(b"Content-Length: %d\r\n" % len(body))
    for name, value in headers:
        if "\r" in value or "\n" in value:  # never let a value start a header of its own
            raise UpstreamError(f"the {name} header holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"\r\n")
    lines.append(body)
    return b"".join(lines)


class ConnectionPool:
    """Keep-alive connections per replica (host, port, TLS), reused most recent first.

    With `warm_seconds` (a callable: the setting is read when it is needed), a kept-alive
    connection the replica closes while it waits in the pool is replaced by a new one
    while it was last used within that many seconds: a burst that comes after a pause
    longer than the replica's own keep-alive (vLLM's: 5 s) finds its connections open,
    the replica's accepting done before its requests came. The replacement is closed by
    the pool when that window ends unless a request used it (vLLM's server, as uvicorn,
    times out only a connection that has carried a request: it would keep it for ever).
    One attempt per closed connection; none for one that was open for less than
    `replace_after` seconds (a server that closes what it accepts is not called in a
    loop)."""

    replace_after = 1.0

    def __init__(self, warm_seconds: Callable[[], float] | None = None) -> None:
        self.idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self.warm_seconds = warm_seconds
        self.reopening: set[asyncio.Task[None]] = set()
        self.shut = False

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context, made on first use."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def connect(self, where: Target) -> Connection:
        """A new connection to the replica (UpstreamError on failure)."""
        loop = asyncio.get_running_loop()
        key = (where.host, where.port, where.tls)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, key),
                    where.host,
                    where.port,
                    ssl=self.tls_context() if where.tls else None,
                )
        except TimeoutError:
            raise UpstreamError(
                f"no connection to {where.host}:{where.port} within {CONNECT_TIMEOUT:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to {where.host}:{where.port}: {exc.strerror or exc}"
            ) from None
        return connection

    def take_idle(self, where: Target) -> Connection | None:
        """A kept-alive connection to the replica, if one is open."""
        idle = self.idle.get((where.host, where.port, where.tls))
        while idle:
            connection = idle.pop()
            if not connection.closed:
                connection.reused = True
                return connection
        return None

    def put_back(self, connection: Connection) -> None:
        """Keep a connection for the next request (up to IDLE_PER_HOST; none once the
        pool is closed)."""
        idle = self.idle.setdefault(connection.key, [])
        if len(idle) < IDLE_PER_HOST and not self.shut:
            idle.append(connection)
        else:
            connection.abort()

    def forget(self, connection: Connection) -> bool:
        """Drop a closed connection from the idle ones; whether it was one of them."""
        idle = self.idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
            return True
        return False

    def closed_while_idle(self, connection: Connection) -> None:
        """The replica closed a kept-alive connection: open another in its place while
        it was used recently (see the class)."""
        if self.shut or self.warm_seconds is None:
            return
        loop = asyncio.get_running_loop()
        now = time.perf_counter()  # the connection's clock (last_heard, opened_at)
        window = self.warm_seconds()
        used_at = connection.last_heard  # the end of its last answer
        if now - used_at >= window or now - connection.opened_at < self.replace_after:
            return
        task = loop.create_task(self.reopen(connection.key, used_at, window))
        self.reopening.add(task)
        task.add_done_callback(self.reopening.discard)

    async def reopen(self, key: tuple[str, int, bool], used_at: float, window: float) -> None:
        """One connection opened to stand idle for the next request until the window
        ends (none on failure: a replica that is gone is not called again)."""
        host, port, tls = key
        try:
            connection = await self.connect(Target(host, port, "", tls, b""))
        except UpstreamError:
            return
        connection.last_heard = used_at  # the window runs from the last request, not this
        if self.shut or connection.closed:
            connection.abort()
            return
        self.put_back(connection)
        connection.loop.call_at(used_at + window, self.expire, connection)

    def expire(self, connection: Connection) -> None:
        """The window of a replacement ended: closed, unless a request used it since
        (it is then an ordinary kept-alive connection, or busy)."""
        if not connection.reused and self.forget(connection):
            connection.abort()

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes = b"",
        headers: tuple[tuple[str, str], ...] = (),
        *,
        head_timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> Response:
        """Send one request to a replica and wait for the answer's status and headers.
        `head_timeout` bounds the wait for them, `idle_timeout` each wait for body bytes
        after them (None: no bound); either one run out is UpstreamStalled."""
        where = target(base_url)
        request = request_bytes(method, where, path, body, headers)
        connection = self.take_idle(where)
        if connection is not None:
            connection.head_timeout, connection.idle_timeout = head_timeout, idle_timeout
            try:
                return await connection.send(request)
            except UpstreamStalled:
                raise  # the replica is there but silent: another connection would wait too
            except UpstreamError:
                # The replica closed the kept-alive connection before reading the request:
                # nothing reached it, so sending again on a new connection is safe.
                if connection.received:
                    raise
        connection = await self.connect(where)
        connection.head_timeout, connection.idle_timeout = head_timeout, idle_timeout
        return await connection.send(request)

    async def get_text(self, base_url: str, path: str,
                       headers: tuple[tuple[str, str], ...] = ()) -> str:
        """GET a text document (a replica's /metrics) whole; a status other than 200 is an
        UpstreamError. Callers bound the wait with asyncio.timeout."""
        response = await self.request("GET", base_url, path, headers=headers)
        try:
            if response.status != 200:
                raise UpstreamError(f"GET {path}: HTTP {response.status}")
            return (await response.read()).decode("utf-8", "replace")
        finally:
            response.release()

    def close(self) -> None:
        """Close every idle connection; none is opened again."""
        self.shut = True
        for task in list(self.reopening):
            task.cancel()
        for idle in list(self.idle.values()):
            for connection in list(idle):
                connection.abort()
        self.idle.clear()

