from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.routes import build_table, routes
from tests.engines import FakeEngine, fake_engines, publish, start_fake_engine  # noqa: F401
from tests.private_loop import all_written
from tests.processes import free_port
from tests.vllm_server import vllm_server


@pytest.fixture(scope="session")
def vllm_url(demo_model_folder: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[str]:
    """One real vLLM server (CPU build, the demo model as `smollm2`) for the session."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # A prompt served partly from the prefix cache takes another kernel path, whose
    # rounding can turn a greedy near-tie: each answer here is computed from scratch.
    with vllm_server(demo_model_folder, "smollm2", log, "--max-model-len", "1024",
                     "--no-enable-prefix-caching") as url:
        yield url


@pytest.fixture(scope="session")
def gateway_url() -> Iterator[str]:
    """The control plane's ASGI application (gateway included) in uvicorn, in this
    process, so tests can hand it route tables."""
    import uvicorn

    from controlplane.http_protocol import HttpProtocol

    port = free_port()
    config = uvicorn.Config("controlplane.asgi:application", host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off", access_log=False,
                            # As `manage.py serve`: forwarded headers are trusted only
                            # through TRUSTED_PROXIES (serving/proxies.py), and the
                            # server's own HTTP protocol.
                            proxy_headers=False, http=HttpProtocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def usage_written_before_the_database_is_emptied() -> Iterator[None]:
    """The in-process gateway writes usage records from its own loop, off the request's
    path: a test's records are all written before the test's database is emptied (an
    INSERT racing PostgreSQL's TRUNCATE of a transactional test deadlocks)."""
    yield
    from serving.gateway import gateway

    resources = gateway._resources
    if resources is None or not resources.loop.is_running():
        return
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(all_written(resources.usage),
                                         resources.loop).result(15)


@pytest.fixture(autouse=True)
def empty_route_table() -> Iterator[None]:
    routes.publish(build_table([]))
    forget_replica_health()
    yield
    routes.publish(build_table([]))


def forget_replica_health() -> None:
    """The in-process gateway keeps each replica's load and failures by name for the
    session, and forgets a replica only at its next load scrape: without this, a replica
    an earlier test made fail sits out of a later test's same-named replica (503
    `no_replica`). Failures only: an in-flight count a stream still running holds stays.
    Done on the gateway's own loop when it runs, so no pass reads the states meanwhile."""
    from serving.gateway import gateway

    def clear() -> None:
        for state in gateway.router.states.values():
            state.failures, state.unhealthy_until = 0, 0.0

    resources = gateway._resources
    if resources is None or not resources.loop.is_running():
        clear()
        return

    async def on_loop() -> None:
        clear()

    asyncio.run_coroutine_threadsafe(on_loop(), resources.loop).result(10)


@pytest.fixture(autouse=True)
def fresh_budgets() -> Iterator[None]:
    """Rate-limit buckets and failed-authentication counts start empty in every test (the
    in-process gateway lives for the session; every test calls from 127.0.0.1)."""
    from serving.gateway import gateway
    from serving.ratelimit import MemoryLimiter

    def reset() -> None:
        if isinstance(gateway.limiter, MemoryLimiter):
            gateway.limiter.buckets.clear()
        flush_redis_budgets()

    reset()
    yield
    reset()


def flush_redis_budgets(url: str = "redis://127.0.0.1:6379/7") -> None:
    import redis

    from serving.ratelimit import REDIS_PREFIX

    connection = redis.Redis.from_url(url)
    names = list(connection.scan_iter(REDIS_PREFIX + "*"))
    if names:
        connection.delete(*names)
    connection.close()
