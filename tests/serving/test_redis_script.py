"""The rate limiter's Redis client (serving/redis_script.py), on real Redis servers: calls
pipelined on one connection each get their own reply; a Redis that forgot the script gets
it again; the URL's database, password and socket are the ones used; a Redis that hangs
fails the calls within the limit and the client recovers when it answers again. The
background work's plain commands (`Commands`) go over the same kind of connection."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serving.redis_script import Commands, ScriptClient, command
from tests.services import private_redis

REDIS = "redis://127.0.0.1:6379/6"
# Adds ARGV[1] to the key's value and returns the key and the new value.
SCRIPT = "return {KEYS[1], redis.call('INCRBY', KEYS[1], ARGV[1])}"


def test_calls_pipelined_on_one_connection_each_get_their_own_reply() -> None:
    async def run() -> None:
        client = ScriptClient(REDIS, SCRIPT)
        keys = [f"test:script:{uuid.uuid4().hex}" for _ in range(200)]
        replies = await asyncio.gather(*(client.run([key], [str(n)])
                                         for n, key in enumerate(keys)))
        assert replies == [[key.encode(), n] for n, key in enumerate(keys)]
        await client.close()

    asyncio.run(run())


def test_a_redis_that_forgot_the_script_is_sent_it_again() -> None:
    async def run() -> None:
        client = ScriptClient(REDIS, SCRIPT)
        key = f"test:script:{uuid.uuid4().hex}"
        assert (await client.run([key], ["2"]))[1] == 2
        redis.Redis.from_url(REDIS).script_flush()
        assert (await client.run([key], ["3"]))[1] == 5
        await client.close()

    asyncio.run(run())


def test_the_database_in_the_url_is_the_one_written() -> None:
    key = f"test:script:{uuid.uuid4().hex}"

    async def run() -> None:
        client = ScriptClient("redis://127.0.0.1:6379/9", SCRIPT)
        await client.run([key], ["4"])
        await client.close()

    asyncio.run(run())
    assert redis.Redis.from_url("redis://127.0.0.1:6379/9").get(key) == b"4"
    assert redis.Redis.from_url("redis://127.0.0.1:6379/0").get(key) is None


def test_an_error_the_script_raises_is_a_response_error() -> None:
    async def run() -> None:
        client = ScriptClient(REDIS, "return redis.error_reply('no such thing')")
        with pytest.raises(ResponseError, match="no such thing"):
            await client.run(["test:script:x"], [])
        await client.close()

    asyncio.run(run())


def test_a_redis_that_hangs_fails_the_calls_in_time_and_they_work_once_it_answers(
) -> None:
    async def run(server_url: str, pid: int) -> None:
        client = ScriptClient(server_url, SCRIPT, timeout=0.5)
        key = f"test:script:{uuid.uuid4().hex}"
        assert (await client.run([key], ["1"]))[1] == 1
        os.kill(pid, signal.SIGSTOP)  # the process is there, its socket open, silent
        try:
            started = time.monotonic()
            outcomes = await asyncio.gather(*(client.run([key], ["1"]) for _ in range(3)),
                                            return_exceptions=True)
            waited = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [type(outcome) for outcome in outcomes] == [RedisTimeoutError] * 3
        assert waited < 2.0
        # The late replies went with the dropped connection: the next call is answered
        # on a new one, after the three that Redis ran when it woke up.
        replies = await asyncio.gather(*(client.run([key], ["1"]) for _ in range(2)))
        assert sorted(reply[1] for reply in replies) == [5, 6]
        await client.close()

    with private_redis() as server:
        assert server.process is not None
        asyncio.run(run(server.url, server.process.pid))


def test_a_password_and_a_unix_socket_in_the_url_are_used_and_a_wrong_password_fails(
        tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    key = f"test:script:{uuid.uuid4().hex}"

    async def run(port: int) -> None:
        for url in (f"redis://:s3cret@127.0.0.1:{port}/3",
                    f"unix://:s3cret@{socket_path}?db=3"):
            client = ScriptClient(url, SCRIPT)
            await client.run([key], ["1"])
            await client.close()
        wrong = ScriptClient(f"redis://:guess@127.0.0.1:{port}/3", SCRIPT)
        with pytest.raises(RedisConnectionError, match="refused the connection's set-up"):
            await wrong.run([key], ["1"])
        await wrong.close()

    with private_redis("--requirepass", "s3cret", "--unixsocket", str(socket_path)) as server:
        asyncio.run(run(server.port))
        stored = redis.Redis(port=server.port, password="s3cret", db=3).get(key)
    assert stored == b"2"


def test_a_tls_url_whose_certificate_file_is_missing_fails_as_a_connection_error(
        tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"

    async def run() -> None:
        client = ScriptClient(f"rediss://127.0.0.1:6379/0?ssl_ca_certs={missing}", SCRIPT)
        with pytest.raises(RedisConnectionError, match="could not connect to Redis"):
            await client.run(["test:script:x"], ["1"])
        await client.close()

    asyncio.run(run())


def test_plain_commands_answer_as_redis_py_does_and_a_broken_connection_is_replaced() -> None:
    key, missing = f"test:commands:{uuid.uuid4().hex}", f"test:commands:{uuid.uuid4().hex}"
    blocking = redis.Redis.from_url(REDIS)

    async def run() -> None:
        client = Commands(REDIS)
        assert await client.set(key, "one", px=5000)
        assert 0 < blocking.pttl(key) <= 5000
        assert await client.mget(key, missing) == [b"one", None]
        assert await client.incr(missing) == 1
        with pytest.raises(ResponseError):  # an error reply: INCR of a text
            await client.incr(key)
        # Redis closes the connection (as on a restart): the next command is sent once
        # more on a new one, not failed.
        blocking.execute_command("CLIENT", "KILL", "ID", await client.send(command(
            b"CLIENT", b"ID")))
        assert await client.mget(key) == [b"one"]
        await client.close()
        with pytest.raises(RedisConnectionError):  # nothing listens there
            await Commands("redis://127.0.0.1:1/0").mget(key)

    try:
        asyncio.run(run())
    finally:
        blocking.delete(key, missing)


def test_a_reply_is_shown_to_the_callers_first_look_before_the_caller_gets_it() -> None:
    """A call's `first_look` sees its reply from the connection's callback, before the
    caller's task resumes with it (the rate limiter hands out verdicts from there, a turn
    of the event loop sooner); an error reply is not shown to it, and a first look that
    fails costs the caller nothing."""
    async def run() -> None:
        client = ScriptClient(REDIS, SCRIPT)
        key = f"test:script:{uuid.uuid4().hex}"
        seen: list[tuple[Any, bool]] = []
        call = asyncio.ensure_future(
            client.run([key], ["2"], lambda reply: seen.append((reply, call.done()))))

        def broken(reply: Any) -> None:
            raise ValueError("a first look that fails")

        other = asyncio.ensure_future(client.run([key], ["3"], broken))
        refused = asyncio.ensure_future(client.run([key], ["not a number"],
                                                   lambda reply: seen.append((reply, False))))
        assert await call == [key.encode(), 2]
        assert seen == [([key.encode(), 2], False)]  # seen before the caller had it
        assert await other == [key.encode(), 5]
        with pytest.raises(ResponseError):
            await refused
        assert len(seen) == 1
        await client.close()

    asyncio.run(run())
