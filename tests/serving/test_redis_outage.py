"""A Redis outage under scale-out: two gateway processes (`manage.py serve
--no-controllers`) and `manage.py run_controllers`, on a private Redis server and a private
PostgreSQL cluster (tests/services.py), in front of external deployments on FAKE engines
(fakes/engine.py). The real Redis server is stopped and started again.

While it is away: keys with rate limits get 503 `limits_unavailable` with Retry-After, keys
without are served, no process dies. Once it answers again: rate limits count again, a key
revoked in the database meanwhile is refused by both gateways, and a deployment created
and one deleted meanwhile reach both gateways' route tables."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.engines import FakeEngine, start_fake_engine
from tests.processes import (
    ROOT,
    Api,
    create_key,
    free_port,
    manage,
    register_fake_model,
    server_env,
    start_server,
    stop_server,
)
from tests.services import PrivateRedis, private_postgres, private_redis

pytestmark = pytest.mark.slow

SCRAPE_SECONDS = 0.2  # GATEWAY_LOAD_SCRAPE_SECONDS of the gateways
# Once Redis answers: a gateway's watcher reads it within one SCRAPE_SECONDS, and a
# controller writes the route table after its next pass (RECONCILE_INTERVAL_SECONDS 0.3).
# The bounds asserted leave room for a machine busy with other tests.
KEYS_BOUND_SECONDS = 5.0
ROUTES_BOUND_SECONDS = 10.0


@dataclass
class Fleet:
    gateways: tuple[str, str]
    servers: list[subprocess.Popen[str]]
    controllers: subprocess.Popen[bytes]
    redis: PrivateRedis
    env: dict[str, str]
    api: Api
    engines: tuple[FakeEngine, FakeEngine]
    keys: dict[str, str]


def routed(url: str, key: str) -> set[str]:
    """The deployments a gateway lists with a ready replica."""
    return {m["id"] for m in Api(url, key).get("/v1/models")["data"] if m["ready_replicas"]}


def add_deployment(api: Api, name: str, engine: FakeEngine) -> None:
    assert api.post("/api/v1/backends/", {"name": name, "kind": "external", "config": {
        "url": engine.url}}).status_code == 201
    response = api.post("/api/v1/deployments/", {"name": name, "model": "fake",
                                                 "backend": name, "replicas": 1})
    assert response.status_code == 201, response.text


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("redis-outage")
    with private_redis() as redis_server, private_postgres() as database:
        env = server_env(base / "data", REDIS_URL=redis_server.url, DATABASE_URL=database.url,
                          RECONCILE_INTERVAL_SECONDS="0.3", HEALTH_CHECK_SECONDS="1",
                          GATEWAY_LOAD_SCRAPE_SECONDS=str(SCRAPE_SECONDS),
                          # A cached key is trusted for 10 minutes: a revocation within
                          # this test can only arrive through Redis.
                          KEY_CACHE_SECONDS="600")
        manage(env, "migrate", "--noinput", "-v0")
        register_fake_model(env, base)
        keys = {"admin": create_key(env, "admin", "--scope", "admin"),
                "limited": create_key(env, "limited", "--rpm", "2"),
                "free": create_key(env, "free"),
                "doomed": create_key(env, "doomed")}
        engines = (start_fake_engine("alpha", model="alpha"),
                   start_fake_engine("beta", model="beta"))
        ports = (free_port(), free_port())
        servers = [start_server(env, port, "--no-controllers")[0] for port in ports]
        controllers = subprocess.Popen([sys.executable, "manage.py", "run_controllers"],
                                       cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        urls = (f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
        api = Api(urls[0], keys["admin"])
        try:
            add_deployment(api, "alpha", engines[0])
            for url in urls:
                api.wait_for("alpha routed", lambda u=url: "alpha" in routed(
                    u, keys["admin"]), 60, 0.2)
            yield Fleet(urls, servers, controllers, redis_server, env, api, engines, keys)
        finally:
            controllers.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                controllers.wait(timeout=30)
            controllers.kill()
            for server in servers:
                stop_server(server)
            for engine in engines:
                engine.process.kill()
                engine.process.wait(timeout=10)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def ask(url: str, key: str, model: str = "alpha") -> Any:
    return client(url, key).completions.create(model=model, prompt="hi", max_tokens=2)


def refusal(url: str, key: str, model: str = "alpha") -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as refused:
        ask(url, key, model)
    return refused.value


def wait_for(what: str, check: Any, seconds: float) -> float:
    """Seconds until `check()` held; fails past `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {seconds:.0f} s")


def refused_with_401(url: str, key: str) -> bool:
    answer = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "alpha", "prompt": "hi", "max_tokens": 2}, timeout=30)
    return answer.status_code == 401


def all_alive(fleet: Fleet) -> bool:
    return (all(server.poll() is None for server in fleet.servers)
            and fleet.controllers.poll() is None
            and all(httpx.get(f"{url}/livez", timeout=5).status_code == 200
                    for url in fleet.gateways))


def test_a_redis_outage_degrades_service_and_everything_recovers_when_it_returns(
        fleet: Fleet) -> None:
    keys, (first, second) = fleet.keys, fleet.gateways
    for url in fleet.gateways:  # every key cached in both gateways before the outage
        for name in ("limited", "free", "doomed"):
            assert ask(url, keys[name]).choices
    fleet.redis.stop()

    # Away: limited keys get 503 limits_unavailable, the others are served.
    for url in fleet.gateways:
        refused = refusal(url, keys["limited"])
        assert refused.status_code == 503, refused.message
        assert refused.body["code"] == "limits_unavailable"  # type: ignore[index]
        assert refused.response.headers["retry-after"] == "1"
        assert ask(url, keys["free"]).choices
    # Changes made meanwhile: a key revoked in the database (by another process, so no
    # gateway hears of it), a deployment created and one deleted through the API.
    manage(fleet.env, "shell", "-c", "from serving.models import ApiKey; "
           "from serving.services import revoke_api_key; "
           "revoke_api_key(ApiKey.objects.get(name='doomed'))")
    add_deployment(fleet.api, "beta", fleet.engines[1])
    assert httpx.delete(f"{first}/api/v1/deployments/alpha/", timeout=30, headers={
        "Authorization": f"Bearer {keys['admin']}"}).status_code in (202, 204)
    fleet.api.wait_for("beta ready in the database", lambda: fleet.api.get(
        "/api/v1/deployments/beta/")["ready_replicas"] == 1, 30, 0.2)
    # The gateways still route with the table they had: the change waits for Redis.
    assert routed(second, keys["admin"]) == {"alpha"}
    assert ask(second, keys["free"]).choices
    assert all_alive(fleet)

    fleet.redis.start()  # empty: nothing was saved
    for url in fleet.gateways:
        wait_for(f"{url} refuses the revoked key", lambda u=url: refused_with_401(
            u, keys["doomed"]), KEYS_BOUND_SECONDS)
        wait_for(f"{url} routes beta and no longer alpha", lambda u=url: routed(
            u, keys["admin"]) == {"beta"}, ROUTES_BOUND_SECONDS)
        assert ask(url, keys["free"], "beta").choices
    # Rate limits count again, across both processes: two a minute, the third refused.
    assert ask(first, keys["limited"], "beta").choices
    assert ask(second, keys["limited"], "beta").choices
    refused = refusal(first, keys["limited"], "beta")
    assert refused.status_code == 429
    assert refused.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert all_alive(fleet)
