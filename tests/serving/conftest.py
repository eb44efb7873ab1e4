from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from serving.routes import build_table, routes
from tests.engines import FakeEngine, fake_engines, publish, start_fake_engine  # noqa: F401
from tests.product import free_port


@pytest.fixture(scope="session")
def gateway_url() -> Iterator[str]:
    """The control plane's ASGI application (gateway included) in uvicorn, in this
    process, so tests can hand it route tables."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config("controlplane.asgi:application", host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off", access_log=False)
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
def empty_route_table() -> Iterator[None]:
    routes.publish(build_table([]))
    yield
    routes.publish(build_table([]))
