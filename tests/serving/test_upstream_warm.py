"""Warm upstream connections: a kept-alive connection the replica closes while it waits in
the pool (the replica's own keep-alive ran out) is replaced by a new one while the replica
was used recently, so the next burst finds its connections open; past the window, on a
failed reconnect or once the pool is closed, nothing is opened again. Against the raw
HTTP/1.1 server of test_upstream.py, on real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serving.upstream import ConnectionPool
from serving.upstream.connection import Connection
from tests.serving.test_upstream import RawServer, server, sized, until

__all__ = ["server"]  # the fixture, used by name


def warm_pool(seconds: float) -> ConnectionPool:
    """A pool keeping connections warm for `seconds`, replacing any that lived 0.05 s."""
    pool = ConnectionPool(lambda: seconds)
    pool.replace_after = 0.05
    return pool


def keep_alive_for(raw: RawServer, seconds: list[float]) -> None:
    """Answer requests on each connection, closing one that stays idle `seconds[0]`
    (read when the wait begins, so a test can lengthen it)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await asyncio.wait_for(raw.read_request(reader), seconds[0])
            except TimeoutError:
                return  # the replica's keep-alive ran out: it closes
            writer.write(sized(b"{}"))
            await writer.drain()

    raw.handler = handler


def open_idle(pool: ConnectionPool) -> list[Connection]:
    return [c for idle in pool.idle.values() for c in idle if not c.closed]


def connection_closed(connection: Connection) -> Callable[[], bool]:
    return lambda: connection.closed


async def ask(pool: ConnectionPool, url: str) -> bool:
    """One request; whether it went on a connection that was open before it."""
    response = await pool.request("POST", url, "/v1/completions", b"{}")
    assert await response.read() == b"{}"
    reused = response._connection.reused
    response.release()
    return reused


async def test_a_connection_the_replica_closes_is_replaced_while_it_was_used_recently(
        server: RawServer) -> None:
    keep_alive = [0.1]
    keep_alive_for(server, keep_alive)
    pool = warm_pool(30.0)
    assert not await ask(pool, server.url)
    keep_alive[0] = 10.0  # the replacement stays open
    await until(lambda: server.connections == 2 and len(open_idle(pool)) == 1,
                "the closed connection to be replaced")
    assert await ask(pool, server.url)  # the next request finds it open
    assert server.connections == 2
    pool.close()
    assert not pool.reopening and not open_idle(pool)


async def test_past_the_window_a_closed_connection_is_let_go(server: RawServer) -> None:
    keep_alive_for(server, [0.2])
    for pool in (warm_pool(0.05), warm_pool(0.0), ConnectionPool()):
        before = server.connections
        assert not await ask(pool, server.url)
        connection = pool.idle[next(iter(pool.idle))][0]
        await until(connection_closed(connection), "the replica to close the connection")
        # The choice is made when the close is seen: nothing is being opened.
        assert not pool.reopening and not open_idle(pool)
        assert server.connections == before + 1
        pool.close()


async def test_a_replica_gone_for_good_is_not_called_again(server: RawServer) -> None:
    keep_alive = [0.1]
    keep_alive_for(server, keep_alive)
    pool = warm_pool(30.0)
    assert not await ask(pool, server.url)
    assert server.server is not None
    server.server.close()  # no longer listening: the replacement's connect fails
    await until(lambda: not pool.idle[next(iter(pool.idle))], "the close to be seen")
    await until(lambda: not pool.reopening, "the failed reconnect to end")
    assert server.connections == 1 and not open_idle(pool)
    pool.close()


async def test_a_connection_closed_as_soon_as_opened_is_not_replaced(
        server: RawServer) -> None:
    keep_alive = [0.2]
    keep_alive_for(server, keep_alive)
    pool = warm_pool(30.0)
    pool.replace_after = 0.15  # the first connection lives 0.2 s, longer
    assert not await ask(pool, server.url)
    keep_alive[0] = 0.0  # from now on the server closes what it accepts at once
    await until(lambda: server.connections == 2, "the first connection to be replaced")
    await until(lambda: not pool.reopening and not open_idle(pool),
                "the replacement to be closed by the server")
    assert server.connections == 2  # not opened again: it lived less than replace_after
    pool.close()


async def test_a_closed_pool_opens_nothing(server: RawServer) -> None:
    keep_alive_for(server, [0.1])
    pool = warm_pool(30.0)
    assert not await ask(pool, server.url)
    connection = pool.idle[next(iter(pool.idle))][0]
    pool.close()
    await until(lambda: connection.closed and not pool.reopening, "the pool to close")
    assert server.connections == 1 and not open_idle(pool)


def test_the_gateway_reads_its_window_from_the_setting(settings) -> None:
    from serving.gateway.resources import warm_seconds

    assert warm_seconds() == 60.0  # the default
    settings.GATEWAY_UPSTREAM_WARM_SECONDS = 0
    assert warm_seconds() == 0.0
