"""Scale-out sees one fleet: two gateway processes (`manage.py serve --no-controllers`) and
a separate `manage.py run_controllers`, sharing a SQLite file and Redis, in front of an
external deployment on a FAKE engine (fakes/engine.py). Each gateway holds one request at
the replica and one in its priority queue (one request per replica at a time); the
controllers' dashboards and autoscaler see both gateways' figures, read as a browser gets
them: the collector's and the autoscaler's messages on the channel layer."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from tests.engines import FakeEngine, start_fake_engine
from tests.processes import ROOT, Api, free_port, manage, server_env, start_server, stop_server

pytestmark = pytest.mark.slow

REDIS = "redis://127.0.0.1:6379/13"  # a database of its own: others use Redis too
HOLD_SECONDS = 8.0  # how long the engine takes over one request


@dataclass
class Messages:
    """What the dashboards of the fleet and of the deployment receive."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    channel: str = ""

    async def listen(self, groups: tuple[str, ...], ready: threading.Event) -> None:
        from channels_redis.core import RedisChannelLayer

        layer = RedisChannelLayer(hosts=[REDIS])
        self.channel = await layer.new_channel()
        for group in groups:
            await layer.group_add(group, self.channel)
        ready.set()
        # Never cancelled mid-receive (a message could be lost): `stop` sends the last one.
        while (message := await layer.receive(self.channel))["type"] != "test.stop":
            self.seen.append(orjson.loads(message["text"]))
        await layer.flush()

    def stop(self) -> None:
        from channels_redis.core import RedisChannelLayer

        if self.channel:
            asyncio.run(RedisChannelLayer(hosts=[REDIS]).send(self.channel,
                                                              {"type": "test.stop"}))

    def wait_for(self, what: str, check: Callable[[dict[str, Any]], bool],
                 seconds: float) -> dict[str, Any]:
        """The first message, from now on, that passes `check`."""
        start = len(self.seen)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for message in self.seen[start:]:
                if check(message):
                    return message
            time.sleep(0.05)
        raise AssertionError(f"no message showed {what} within {seconds:.0f} s; the last: "
                             f"{self.seen[-3:]!r}")


@dataclass
class Fleet:
    gateways: tuple[str, str]
    key: str
    engine: FakeEngine
    messages: Messages


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import redis

    redis.Redis.from_url(REDIS).flushdb()  # routes, figures, groups of an earlier run
    base = tmp_path_factory.mktemp("figures")
    env = server_env(base / "data", REDIS_URL=REDIS, RECONCILE_INTERVAL_SECONDS="0.3",
                      HEALTH_CHECK_SECONDS="1", GATEWAY_LOAD_SCRAPE_SECONDS="0.2",
                      SCRAPE_INTERVAL="0.5", SCRAPE_TIMEOUT="0.4")
    manage(env, "migrate", "--noinput", "-v0")
    weights = base / "weights"
    weights.mkdir()
    manage(env, "shell", "-c", "from tests.factories import make_model; "
                               f"make_model('fake', path={str(weights)!r})")
    key = manage(env, "create_api_key", "--name", "tests", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    engine = start_fake_engine("edge", model="shared", interval_ms=HOLD_SECONDS * 1000 / 100)
    ports = (free_port(), free_port())
    servers = [start_server(env, port, "--no-controllers")[0] for port in ports]
    controllers = subprocess.Popen([sys.executable, "manage.py", "run_controllers"],
                                   cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    messages = Messages()
    ready = threading.Event()
    listener = threading.Thread(target=asyncio.run, daemon=True, args=(messages.listen(
        ("dashboard.fleet", "dashboard.deployment.shared"), ready),))
    listener.start()
    urls = (f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
    api = Api(urls[0], key)
    try:
        assert ready.wait(10)
        assert api.post("/api/v1/backends/", {"name": "edge", "kind": "external", "config": {
            "url": engine.url}}).status_code == 201
        response = api.post("/api/v1/deployments/", {
            "name": "shared", "model": "fake", "backend": "edge", "replicas": 1,
            "min_replicas": 1, "max_replicas": 1,
            "admission": {"replica_concurrency": 1},
            "autoscaling": {"signals": [{"name": "queue_per_replica", "target": 1}]}})
        assert response.status_code == 201, response.text
        for url in urls:
            Api(url, key).wait_for("the replica routed", lambda u=url: any(
                m["id"] == "shared" and m["ready_replicas"]
                for m in Api(u, key).get("/v1/models")["data"]), 60, 0.2)
        yield Fleet(urls, key, engine, messages)
    finally:
        messages.stop()
        listener.join(timeout=10)
        controllers.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            controllers.wait(timeout=30)
        controllers.kill()
        for server in servers:
            stop_server(server)
        engine.process.kill()
        engine.process.wait(timeout=10)


def ask(url: str, key: str, answers: list[tuple[int, str]], tokens: int = 100) -> None:
    """A streamed completion (a streamed answer is in flight from its first byte on)."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "shared", "prompt": "hi", "max_tokens": tokens,
                            "stream": True}) as answer:
        answers.append((answer.status_code, answer.read().decode()[-300:]))


def shared(message: dict[str, Any]) -> dict[str, Any]:
    """The deployment's summary in a fleet message (the whole view, or a delta that
    changed it); {} in any other message."""
    rows = {"fleet": "deployments", "fleet.delta": "changed"}.get(message.get("type", ""))
    if rows is None:
        return {}
    return next((d for d in message[rows] if d["name"] == "shared"), {})


def counted(messages: list[dict[str, Any]]) -> float:
    """Requests the deployment's dashboard counted: each pass's rate over its interval."""
    samples = [m["gateway"] for m in messages if m.get("type") == "update"]
    return sum((now["requests_per_s"] or 0.0) * (now["t"] - before["t"])
               for before, now in itertools.pairwise(samples))


def test_the_controllers_see_the_figures_of_every_gateway_process(fleet: Fleet) -> None:
    answers: list[tuple[int, str]] = []
    # A first answer from each process: the deployment's request rate is known from then on.
    for url in fleet.gateways:
        ask(url, fleet.key, answers, tokens=1)
    fleet.messages.wait_for("a request rate", lambda m: m.get("type") == "update" and
                            m["gateway"]["requests_per_s"] is not None, 10)
    answers.clear()
    asking = [threading.Thread(target=ask, args=(url, fleet.key, answers))
              for url in fleet.gateways for _ in range(2)]
    for thread in asking:
        thread.start()
    # One request at the replica and one queued, in each of the two gateway processes.
    busy = fleet.messages.wait_for("2 in flight and 2 queued", lambda m: shared(m).get(
        "in_flight") == 2 and shared(m).get("queued") == 2, HOLD_SECONDS)
    decision = fleet.messages.wait_for(
        "the autoscaler's queue signal at 2", lambda m: m.get("type") == "decision" and
        m["decision"]["signals"]["queue_per_replica"]["value"] == 2, HOLD_SECONDS)
    assert decision["deployment"] == "shared"
    start = fleet.messages.seen.index(busy)
    for thread in asking:
        thread.join(timeout=4 * HOLD_SECONDS)
    assert [status for status, _ in answers] == [200, 200, 200, 200], answers
    # The four requests, counted from the moment both processes' figures were in.
    fleet.messages.wait_for("every request counted", lambda m: round(
        counted(fleet.messages.seen[start:])) == 4, 10)
    idle = fleet.messages.wait_for("nothing left in flight", lambda m: shared(m).get(
        "in_flight") == 0 and shared(m).get("queued") == 0, 10)
    assert shared(idle)["requests_per_s"] > 0  # over the summary window
