"""Warm upstream connections: a kept-alive connection the replica closes while it waits in
the pool (the replica's own keep-alive ran out) is replaced by a new one while it was used
recently, so the next burst finds its connections open; the pool closes the replacement
when the window ends (a server like vLLM's keeps a connection that carried no request for
ever); past the window, on a failed reconnect, for a connection closed soon after it
opened, or once the pool is closed, nothing is opened again. Against the raw HTTP/1.1
server of test_upstream.py, on real sockets."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from serving.upstream import ConnectionPool
from serving.upstream.connection import Connection
from serving.upstream.pool import Target
from tests.processes import ROOT
from tests.serving.test_upstream import RawServer, server, sized, until

__all__ = ["server"]  # the fixture, used by name


@dataclass
class Replica:
    """How the raw server treats its connections, as uvicorn (vLLM's server) does: one
    that carried a request is closed `keep_alive` seconds after its answer; one that
    carried none is kept for ever, or closed after `fresh_for` seconds when set. Read
    when each wait begins, so a test can change them."""

    keep_alive: float
    fresh_for: float | None = None


def serve_like(raw: RawServer, replica: Replica) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fresh = True
        while True:
            limit = replica.fresh_for if fresh else replica.keep_alive
            try:
                await asyncio.wait_for(raw.read_request(reader), limit)
            except TimeoutError:
                return  # the replica closes it
            fresh = False
            writer.write(sized(b"{}"))
            await writer.drain()

    raw.handler = handler


def warm_pool(seconds: float) -> ConnectionPool:
    """A pool keeping connections warm for `seconds`, replacing any that lived 0.05 s."""
    pool = ConnectionPool(lambda: seconds)
    pool.replace_after = 0.05
    return pool


def open_idle(pool: ConnectionPool) -> list[Connection]:
    return [c for idle in pool.idle.values() for c in idle if not c.closed]


def closed(connection: Connection) -> Callable[[], bool]:
    return lambda: connection.closed


async def ask(pool: ConnectionPool, url: str) -> bool:
    """One request; whether it went on a connection that was open before it."""
    response = await pool.request("POST", url, "/v1/completions", b"{}")
    assert await response.read() == b"{}"
    reused = response._connection.reused
    response.release()
    return reused


async def replacement(pool: ConnectionPool, raw: RawServer) -> Connection:
    """The connection opened in place of the first one, once it waits in the pool."""
    await until(lambda: raw.connections == 2 and len(open_idle(pool)) == 1,
                "the closed connection to be replaced")
    return open_idle(pool)[0]


async def test_a_connection_the_replica_closes_is_replaced_and_the_next_request_uses_it(
        server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=0.1))
    pool = warm_pool(30.0)
    assert not await ask(pool, server.url)
    standing = await replacement(pool, server)
    assert await ask(pool, server.url)  # the next request finds it open
    assert server.connections == 2
    # Used by a request, it is an ordinary kept-alive connection: the end of the window
    # it was opened for does not close it.
    assert standing in open_idle(pool)
    pool.expire(standing)
    assert not standing.closed and standing in open_idle(pool)
    pool.close()


async def test_the_pool_closes_a_replacement_when_the_window_ends(server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=0.1))  # a fresh connection is kept for ever
    pool = warm_pool(1.0)
    assert not await ask(pool, server.url)
    standing = await replacement(pool, server)
    await until(closed(standing), "the window to end")
    assert not pool.reopening and not open_idle(pool)  # closed by the pool: not replaced
    assert server.connections == 2
    pool.close()


async def test_past_the_window_a_closed_connection_is_let_go(server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=0.2))
    for pool in (warm_pool(0.05), warm_pool(0.0), ConnectionPool()):
        before = server.connections
        assert not await ask(pool, server.url)
        connection = pool.idle[next(iter(pool.idle))][0]
        await until(closed(connection), "the replica to close the connection")
        # The choice is made when the close is seen: nothing is being opened.
        assert not pool.reopening and not open_idle(pool)
        assert server.connections == before + 1
        pool.close()


async def test_a_replica_gone_for_good_is_called_once(server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=0.1))
    pool = warm_pool(30.0)
    connect = pool.connect
    attempts = 0

    async def counted(where: Target) -> Connection:
        nonlocal attempts
        attempts += 1
        return await connect(where)

    pool.connect = counted  # type: ignore[method-assign]
    assert not await ask(pool, server.url)
    assert server.server is not None
    server.server.close()  # no longer listening: the replacement's connect fails
    await until(lambda: attempts == 2 and not pool.reopening, "the failed reconnect")
    assert server.connections == 1 and not open_idle(pool)
    pool.close()


async def test_a_connection_closed_soon_after_it_opened_is_not_replaced(
        server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=1.0, fresh_for=0.2))
    pool = warm_pool(30.0)
    pool.replace_after = 0.8  # the first lives 1 s after its answer, the second 0.2 s
    assert not await ask(pool, server.url)
    standing = await replacement(pool, server)
    await until(closed(standing), "the server to close the replacement")
    assert not pool.reopening and not open_idle(pool)
    assert server.connections == 2
    pool.close()


async def test_a_closed_pool_opens_and_keeps_nothing(server: RawServer) -> None:
    serve_like(server, Replica(keep_alive=0.1))
    pool = warm_pool(30.0)
    assert not await ask(pool, server.url)
    connect = pool.connect
    entered, gate = asyncio.Event(), asyncio.Event()

    async def gated(where: Target) -> Connection:
        entered.set()
        await gate.wait()
        return await connect(where)

    pool.connect = gated  # type: ignore[method-assign]
    await asyncio.wait_for(entered.wait(), 5)  # a replacement is being opened
    pool.close()
    gate.set()
    await until(lambda: not pool.reopening, "the replacement to be given up")
    assert server.connections == 1 and not open_idle(pool)
    # An answer that ends after the pool closed does not leave its connection there.
    pool.connect = connect  # type: ignore[method-assign]
    response = await pool.request("POST", server.url, "/v1/completions", b"{}")
    assert await response.read() == b"{}"
    response.release()
    assert response._connection.closed and not open_idle(pool)


def test_the_gateway_reads_its_window_from_the_setting(settings) -> None:
    from serving.gateway.resources import warm_seconds

    assert warm_seconds() == 60.0  # the default
    settings.GATEWAY_UPSTREAM_WARM_SECONDS = 0
    assert warm_seconds() == 0.0


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "GATEWAY_UPSTREAM_WARM_SECONDS=-1 is below the minimum of 0"),
    ("86401", "GATEWAY_UPSTREAM_WARM_SECONDS=86401 is above the maximum of 86400"),
    ("soon", "GATEWAY_UPSTREAM_WARM_SECONDS='soon' is not a number"),
])
def test_a_bad_window_is_refused_at_start(value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import controlplane.settings"], cwd=ROOT,
        env={**os.environ, "GATEWAY_UPSTREAM_WARM_SECONDS": value},
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr


def test_the_fake_engine_refuses_a_keep_alive_of_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fakes.engine", "--port", "1", "--keep-alive", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--keep-alive takes a number of seconds above 0" \
        in result.stderr
