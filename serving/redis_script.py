"""The event loop's light Redis clients: the rate limiter's (`ScriptClient`: one Lua script
run over one connection per event loop, the calls pipelined on it, each written as it
comes, the replies matched in order and parsed by hiredis) and the background work's
(`Commands`: the load watcher's MGET once a second and its INCR of a key change Redis
missed, the figures publisher's SET, on a connection of their own rather than through
redis-py's pool).

The check runs before the first byte of every rate-limited request, and the tokens are
charged after each answer. redis-py's asyncio client spent about 170 µs of CPU per call
(its pool's lock and condition, its retry wrapper, its stream reader and a timeout context
per read), more than the rest of the request's path; this one spends a write, a parse and
a future.

What it keeps of the client it replaces: a call fails within TIMEOUT_SECONDS when Redis
stops answering (the connection is then dropped, so no later reply is taken for another
call's); a call that finds its connection broken (Redis restarted) is sent once more on a
new one, so the first checks after a restart are counted, not refused; errors are
redis-py's own classes, which the callers catch. EVALSHA is sent, and the script itself
only when Redis answers that it does not have it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
from collections.abc import Callable
from typing import Any

import hiredis
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serving.redis_clients import CONNECT_TIMEOUT_SECONDS, TIMEOUT_SECONDS

# Called with a reply from the connection's callback, as it comes.
FirstLook = Callable[[Any], None]


def command(*parts: bytes | str | int) -> bytes:
    """One command in Redis's protocol (RESP): an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(out)


class Wire(asyncio.Protocol):
    """One connection: commands written in order, each reply handed to the oldest call
    still waiting (and first, from the connection's callback, to the call's `first_look`
    when it gave one: the caller's task would see the reply only a turn of the event loop
    later)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[tuple[asyncio.Future[Any], FirstLook | None]] = (
            collections.deque())
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: the stream cannot be trusted
                self.drop(RedisConnectionError("Redis sent a reply nobody waited for"))
                return
            call, first_look = self.waiting.popleft()
            if first_look is not None and not isinstance(reply, hiredis.ReplyError):
                try:
                    first_look(reply)
                except Exception:  # the caller reads the reply again, and gets the fault
                    pass
            if not call.done():
                call.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail_waiting(RedisConnectionError("Redis closed the connection"
                                               + (f" ({exc})" if exc else "")))

    def fail_waiting(self, error: Exception) -> None:
        """The connection is of no more use: every call waiting on it fails with
        `error`."""
        self.lost = True
        while self.waiting:
            call, _ = self.waiting.popleft()
            if not call.done():
                call.set_exception(error)

    def drop(self, error: Exception) -> None:
        """Fail every call waiting with `error` and close the connection."""
        self.fail_waiting(error)
        if self.transport is not None:
            self.transport.abort()

    async def call(self, request: bytes, first_look: FirstLook | None = None) -> Any:
        """Send one command; its reply (an error reply as a hiredis.ReplyError), given
        first to `first_look` unless an error reply."""
        if self.lost or self.transport is None or self.transport.is_closing():
            raise RedisConnectionError("the connection to Redis is closed")
        reply = self.loop.create_future()
        self.waiting.append((reply, first_look))
        self.transport.write(request)
        timer = self.loop.call_later(self.timeout, self.stalled, reply)
        try:
            return await reply
        finally:
            timer.cancel()

    def stalled(self, reply: asyncio.Future[Any]) -> None:
        """No reply within the limit: Redis hangs. Every call waiting on the connection
        times out with this one (not tried again: that would wait as long once more), and
        the connection is dropped (a late reply would be matched to the wrong call)."""
        if not reply.done():
            self.drop(RedisTimeoutError(f"Redis did not answer within {self.timeout:g} s"))


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """TLS for a `rediss://` URL: the system's certificates, or `ssl_ca_certs`; with
    `ssl_cert_reqs=none`, no check of the server's certificate (as redis-py's own)."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    if str(options.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class WireClient:
    """One pipelined connection to the Redis at `url`, for the event loop that uses it:
    opened on first use and again after it broke (see `send`)."""

    def __init__(self, url: str, *, timeout: float = TIMEOUT_SECONDS,
                 connect_timeout: float = CONNECT_TIMEOUT_SECONDS) -> None:
        self.options = parse_url(url)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.wire: Wire | None = None
        self.connecting: asyncio.Task[Wire] | None = None

    async def send(self, request: bytes, unknown_script: bytes | None = None,
                   first_look: FirstLook | None = None) -> Any:
        """The reply to `request` (ResponseError for an error reply; redis-py's
        ConnectionError or TimeoutError when Redis cannot be reached or does not answer).
        A request that finds its connection broken is sent once more on a new one; with
        `unknown_script`, that is sent instead when Redis answers it lacks the script.
        `first_look` sees the reply as it comes (Wire), before this returns it."""
        for attempt in (1, 2):
            wire = await self.connection()
            try:
                reply = await wire.call(request, first_look)
                if (unknown_script is not None and isinstance(reply, hiredis.ReplyError)
                        and str(reply).startswith("NOSCRIPT")):
                    reply = await wire.call(unknown_script, first_look)
            except RedisTimeoutError:
                raise
            except RedisConnectionError:
                if attempt == 2:
                    raise
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise ResponseError(str(reply))
            return reply
        raise AssertionError("unreachable")

    async def connection(self) -> Wire:
        """The open connection, or a new one (callers arriving meanwhile share it)."""
        wire = self.wire
        if wire is not None and not wire.lost:
            return wire
        if self.connecting is None or self.connecting.done():
            self.connecting = asyncio.get_running_loop().create_task(self.connect())
        return await asyncio.shield(self.connecting)

    async def connect(self) -> Wire:
        """Open a connection, authenticate and select the database as the URL says."""
        options, loop = self.options, asyncio.get_running_loop()
        kind = options.get("connection_class")
        try:
            if kind is UnixDomainSocketConnection:
                opening = loop.create_unix_connection(lambda: Wire(self.timeout),
                                                      options["path"])
            else:
                context = tls_context(options) if kind is SSLConnection else None
                opening = loop.create_connection(
                    lambda: Wire(self.timeout), options.get("host", "localhost"),
                    int(options.get("port", 6379)), ssl=context)
            _, wire = await asyncio.wait_for(opening, self.connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"could not connect to Redis: {exc}") from exc
        try:
            if options.get("password"):
                login = [options["username"]] if options.get("username") else []
                await self.checked(wire, command(b"AUTH", *login, options["password"]))
            if int(options.get("db") or 0):
                await self.checked(wire, command(b"SELECT", int(options["db"])))
        except BaseException:
            wire.drop(RedisConnectionError("the connection to Redis was given up"))
            raise
        self.wire = wire
        return wire

    async def checked(self, wire: Wire, request: bytes) -> None:
        """Send a set-up command; refused, the connection is of no use."""
        reply = await wire.call(request)
        if isinstance(reply, hiredis.ReplyError):
            raise RedisConnectionError(f"Redis refused the connection's set-up: {reply}")

    async def close(self) -> None:
        """Close the connection."""
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()
        if self.wire is not None:
            self.wire.drop(RedisConnectionError("the client was closed"))
            self.wire = None


class ScriptClient(WireClient):
    """Runs one Lua script on the Redis at `url`, for the event loop that uses it."""

    def __init__(self, url: str, script: str, *, timeout: float = TIMEOUT_SECONDS,
                 connect_timeout: float = CONNECT_TIMEOUT_SECONDS) -> None:
        super().__init__(url, timeout=timeout, connect_timeout=connect_timeout)
        self.script = script.encode()
        self.sha = hashlib.sha1(self.script).hexdigest().encode()

    async def run(self, keys: list[str], args: list[str],
                  first_look: FirstLook | None = None) -> Any:
        """The script's reply (EVALSHA; the script itself when Redis lacks it), shown
        first to `first_look` as it comes."""
        numbers: list[bytes | str | int] = [len(keys), *keys, *args]
        return await self.send(command(b"EVALSHA", self.sha, *numbers),
                               command(b"EVAL", self.script, *numbers), first_look)


class Commands(WireClient):
    """The few plain commands the event loop's background work sends (the load watcher's
    key version and route table, the figures publisher's snapshot) over the same kind of
    connection, with the names and replies of redis-py's client."""

    async def incr(self, key: str) -> int:
        return int(await self.send(command(b"INCR", key)))

    async def mget(self, *keys: str) -> list[bytes | None]:
        return list(await self.send(command(b"MGET", *keys)))

    async def set(self, key: str, value: str | bytes, px: int | None = None) -> bool:
        extra: list[bytes | str | int] = [b"PX", px] if px is not None else []
        return bool(await self.send(command(b"SET", key, value, *extra)))
