"""A key revoked through one process is refused by another gateway process, told only by
the product itself through Redis: `manage.py serve` (controllers included) and `manage.py
serve --no-controllers` sharing a SQLite file and a private `redis-server`, in front of
an external deployment on a FAKE engine (fakes/engine.py). The second gateway caches
keys for far longer than the test waits (KEY_CACHE_SECONDS=600), so only the
announcement through Redis can make it refuse the key in time; the test publishes
nothing itself."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.engines import FakeEngine, start_fake_engine
from tests.processes import (
    Api,
    create_key,
    free_port,
    manage,
    register_fake_model,
    server_env,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow

SCRAPE_SECONDS = 0.2  # GATEWAY_LOAD_SCRAPE_SECONDS: how often a gateway reads Redis


@dataclass
class TwoGateways:
    admin: Api  # the process with the controllers: the REST API used to revoke
    edge: str  # the gateway-only process
    key: str  # an inference key, to be revoked
    key_id: int
    engine: FakeEngine


def private_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server of this test's own, on a free port (the shared one is never touched)."""
    server = shutil.which("redis-server")
    assert server, "redis-server is not installed"
    port = free_port()
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", str(folder)],
                               stdout=subprocess.DEVNULL)
    import redis

    connection = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            connection.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoGateways]:
    base = tmp_path_factory.mktemp("revocation")
    redis_process, redis_url = private_redis(base)
    env = server_env(base / "data", REDIS_URL=redis_url, RECONCILE_INTERVAL_SECONDS="0.3",
                     HEALTH_CHECK_SECONDS="1", GATEWAY_LOAD_SCRAPE_SECONDS=str(SCRAPE_SECONDS),
                     KEY_CACHE_SECONDS="600")
    manage(env, "migrate", "--noinput", "-v0")
    register_fake_model(env, base)
    admin_key = create_key(env, "operator", "--scope", "admin")
    key = create_key(env, "app", "--scope", "inference")
    engine = start_fake_engine("revoke-1", model="fake", interval_ms=20)
    ports = (free_port(), free_port())
    servers = [start_server(env, ports[0])[0],
               start_server(env, ports[1], "--no-controllers")[0]]
    admin = Api(f"http://127.0.0.1:{ports[0]}", admin_key)
    try:
        assert admin.post("/api/v1/backends/", {"name": "edge", "kind": "external", "config": {
            "url": engine.url}}).status_code == 201
        response = admin.post("/api/v1/deployments/", {"name": "fake", "model": "fake",
                                                       "backend": "edge", "replicas": 1})
        assert response.status_code == 201, response.text
        key_id = next(k["id"] for k in admin.get("/api/v1/keys/")["results"]
                      if k["name"] == "app")
        yield TwoGateways(admin, f"http://127.0.0.1:{ports[1]}", key, key_id, engine)
    finally:
        for server in servers:
            stop_server(server)
        engine.process.kill()
        redis_process.terminate()
        redis_process.wait(timeout=15)


def answered(url: str, key: str) -> bool:
    """Whether the gateway at `url` answers a completion for `key` (False while the route
    table has not reached it yet)."""
    try:
        openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).completions.create(
            model="fake", prompt="hi", max_tokens=1)
    except openai.NotFoundError:
        return False
    except openai.APIStatusError as error:
        if error.status_code == 503:  # known, no ready replica yet
            return False
        raise
    return True


def test_a_key_revoked_through_the_api_of_one_process_is_refused_by_another_gateway(
    gateways: TwoGateways,
) -> None:
    edge = openai.OpenAI(base_url=f"{gateways.edge}/v1", api_key=gateways.key, max_retries=0)
    gateways.admin.wait_for("the edge gateway to route the deployment",
                            lambda: answered(gateways.edge, gateways.key), 60, 0.2)
    assert edge.completions.create(model="fake", prompt="hi", max_tokens=1).choices
    # A stream through the edge gateway, running when the key is revoked.
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{gateways.edge}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {gateways.key}"},
                          json={"model": "fake", "prompt": "hi", "max_tokens": 1000,
                                "stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    assert started.wait(30), "the stream through the edge gateway never began"

    revoked = gateways.admin.post(f"/api/v1/keys/{gateways.key_id}/revoke/")
    assert revoked.status_code == 200, revoked.text

    def refused() -> bool:
        try:
            edge.completions.create(model="fake", prompt="hi", max_tokens=1)
        except openai.AuthenticationError as error:
            return error.code == "invalid_api_key"
        return False

    gateways.admin.wait_for("the edge gateway to refuse the revoked key", refused, 30, 0.05)
    # Within 30 s, far inside the edge's key cache (600 s): the refusal came through Redis.
    streaming.join(timeout=30)
    assert not streaming.is_alive()
    assert '"api_key_revoked"' in events[-1]
    assert len(events) < 1000  # cut off, not run to its end
