"""`manage.py serve --workers 2`: two gateway worker processes on one port (SO_REUSEPORT)
and the controllers once, in their parent, on a private Redis server, in front of an
external deployment on a FAKE engine (fakes/engine.py). Every request goes out on a fresh
connection, so the kernel spreads them over both workers; the workers' own figures in
Redis (one snapshot per process, serving/figures.py) say which worker took how many."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest

from controlplane.workers import CRASH_LOOP_SECONDS
from tests.engines import FakeEngine, start_fake_engine
from tests.processes import (
    ROOT,
    Api,
    create_key,
    free_port,
    manage,
    register_fake_model,
    server_env,
    server_output,
    start_server,
)
from tests.services import private_redis

pytestmark = pytest.mark.slow

DEPLOYMENT = "spread"


@dataclass
class Fleet:
    url: str
    admin: str
    redis_url: str
    env: dict[str, str]
    server: subprocess.Popen[str]
    engine: FakeEngine


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("workers")
    with private_redis() as redis_server:
        env = server_env(base / "data", REDIS_URL=redis_server.url,
                         RECONCILE_INTERVAL_SECONDS="0.3", HEALTH_CHECK_SECONDS="1",
                         GATEWAY_LOAD_SCRAPE_SECONDS="0.2",
                         # The revoked key's refusals are counted as failed attempts.
                         GATEWAY_AUTH_FAILURES_PER_MINUTE="0")
        manage(env, "migrate", "--noinput", "-v0")
        register_fake_model(env, base)
        admin = create_key(env, "tests", "--scope", "admin")
        engine = start_fake_engine("edge", model=DEPLOYMENT, interval_ms=1)
        port = free_port()
        server, _ = start_server(env, port, "--workers", "2")
        url = f"http://127.0.0.1:{port}"
        api = Api(url, admin)
        try:
            assert api.post("/api/v1/backends/", {"name": "edge", "kind": "external",
                                                  "config": {"url": engine.url}}
                            ).status_code == 201
            assert api.post("/api/v1/deployments/", {
                "name": DEPLOYMENT, "model": "fake", "backend": "edge", "replicas": 1}
            ).status_code == 201
            # Every worker routes it: 20 fresh connections in a row all answered.
            api.wait_for("the replica routed by both workers", lambda: all(
                any(m["id"] == DEPLOYMENT and m["ready_replicas"]
                    for m in api.get("/v1/models")["data"]) for _ in range(20)), 60, 0.2)
            yield Fleet(url, admin, redis_server.url, env, server, engine)
        finally:
            if server.poll() is None:
                server.kill()  # its workers follow it (PR_SET_PDEATHSIG)
                server.wait(timeout=15)
            engine.process.kill()
            engine.process.wait(timeout=10)


def new_key(fleet: Fleet, name: str, **fields: object) -> tuple[int, str]:
    created = Api(fleet.url, fleet.admin).post("/api/v1/keys/", {
        "name": name, **fields})
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


def ask(fleet: Fleet, key: str) -> httpx.Response:
    """One streamed chat completion on a connection of its own."""
    return httpx.post(f"{fleet.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": DEPLOYMENT, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "Hi"}]})


def answered_per_worker(fleet: Fleet) -> dict[str, float]:
    """Requests each live worker has answered for the deployment, from its own snapshot."""
    import redis

    from serving.figures import REDIS_PREFIX

    connection = redis.Redis.from_url(fleet.redis_url)
    try:
        return {key.decode(): json.loads(connection.get(key) or "{}").get(
                    "requests", {}).get(DEPLOYMENT, [0])[0]
                for key in connection.scan_iter(match=REDIS_PREFIX + "*")}
    finally:
        connection.close()


def usage_of(fleet: Fleet, key_id: int) -> tuple[int, int]:
    """(usage records of a key, distinct record ids among them), read from the database."""
    out = manage(fleet.env, "shell", "-c", (
        "from serving.models import UsageRecord as U; "
        f"q = U.objects.filter(key_id={key_id}); "
        "print(q.count(), q.values('record_id').distinct().count())"))
    count, distinct = out.stdout.split()[-2:]
    return int(count), int(distinct)


def requests_total(fleet: Fleet) -> float:
    """fleetplane_gateway_requests_total for the deployment's 200s, from /metrics."""
    text = httpx.get(f"{fleet.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fleetplane_gateway_requests_total{")
               and f'deployment="{DEPLOYMENT}"' in line and 'status="200"' in line)


def test_both_workers_answer_and_every_figure_counts_each_request_once(fleet: Fleet
                                                                      ) -> None:
    key_id, key = new_key(fleet, "spread")
    before = requests_total(fleet)
    answers = [ask(fleet, key) for _ in range(40)]
    assert [a.status_code for a in answers] == [200] * 40, answers[0].text
    assert all("[DONE]" in a.text for a in answers)
    # Both workers took some; their snapshots (published every second) add up to 40 more.
    Api(fleet.url, fleet.admin).wait_for("both workers' figures", lambda: sum(
        answered_per_worker(fleet).values()) >= 40, 10, 0.2)
    per_worker = answered_per_worker(fleet)
    assert len(per_worker) == 2 and min(per_worker.values()) > 0, per_worker
    assert sum(per_worker.values()) == 40, per_worker
    # /metrics, whichever worker answers it, sums both workers.
    assert [requests_total(fleet) - before for _ in range(6)] == [40.0] * 6
    # Each usage record written once, by the worker that relayed the request. The key's
    # total is written in the same transaction as its records: waited for through the
    # API (a check a fifth of a second), then the records counted in the database.
    api = Api(fleet.url, fleet.admin)
    try:
        api.wait_for("the key's 40 requests written", lambda: api.get(
            f"/api/v1/keys/{key_id}/")["requests_total"] >= 40, 60, 0.2)
    except AssertionError as exc:
        printed = "".join(line for line in server_output(fleet.server).splitlines(
            keepends=True) if " INFO serving.gateway: " not in line)  # not each request
        raise AssertionError(f"{exc}\nthe server printed:\n{printed[-4000:]}") from None
    assert usage_of(fleet, key_id) == (40, 40)
    assert api.get(f"/api/v1/keys/{key_id}/")["requests_total"] == 40


def in_flight(fleet: Fleet, deployment: str) -> float:
    """fleetplane_gateway_in_flight_requests for a deployment, from /metrics."""
    text = httpx.get(f"{fleet.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fleetplane_gateway_in_flight_requests{")
               and f'deployment="{deployment}"' in line)


def test_requests_in_flight_in_both_workers_are_summed(fleet: Fleet) -> None:
    engine = start_fake_engine("slow", model="slow", interval_ms=50)
    api = Api(fleet.url, fleet.admin)
    try:
        assert api.post("/api/v1/backends/", {"name": "slow-edge", "kind": "external",
                                              "config": {"url": engine.url}}
                        ).status_code == 201
        assert api.post("/api/v1/deployments/", {"name": "slow", "model": "fake",
                                                 "backend": "slow-edge", "replicas": 1}
                        ).status_code == 201
        api.wait_for("the slow replica routed by both workers", lambda: all(
            any(m["id"] == "slow" and m["ready_replicas"]
                for m in api.get("/v1/models")["data"]) for _ in range(20)), 60, 0.2)
        _, key = new_key(fleet, "holding")
        # 8 streams of 400 tokens at 50 ms each: 20 s in flight, over both workers.
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(httpx.post, f"{fleet.url}/v1/completions", timeout=60,
                                   headers={"Authorization": f"Bearer {key}"},
                                   json={"model": "slow", "prompt": "hi", "max_tokens": 400,
                                         "stream": True}) for _ in range(8)]
            api.wait_for("8 in flight", lambda: in_flight(fleet, "slow") == 8, 8, 0.1)
            assert [in_flight(fleet, "slow") for _ in range(6)] == [8.0] * 6
            assert [f.result().status_code for f in streams] == [200] * 8
        api.wait_for("none in flight", lambda: in_flight(fleet, "slow") == 0, 10, 0.2)
    finally:
        engine.process.kill()
        engine.process.wait(timeout=10)


def test_a_rate_limit_holds_across_workers(fleet: Fleet) -> None:
    _, key = new_key(fleet, "tight", rpm=5)
    statuses = [ask(fleet, key).status_code for _ in range(16)]
    assert sorted(statuses) == [200] * 5 + [429] * 11, statuses


def test_a_key_revoked_through_the_api_is_refused_by_every_worker(fleet: Fleet) -> None:
    key_id, key = new_key(fleet, "revoked")
    assert [ask(fleet, key).status_code for _ in range(10)] == [200] * 10  # cached by both
    revoked = Api(fleet.url, fleet.admin).post(f"/api/v1/keys/{key_id}/revoke/")
    assert revoked.status_code == 200, revoked.text
    # Other workers learn it through Redis within GATEWAY_LOAD_SCRAPE_SECONDS.
    Api(fleet.url, fleet.admin).wait_for("the key refused", lambda: all(
        ask(fleet, key).status_code == 401 for _ in range(10)), 10, 0.2)
    assert [ask(fleet, key).status_code for _ in range(30)] == [401] * 30


def workers_of(fleet: Fleet) -> list[psutil.Process]:
    """The server's worker processes (its other children: the collector's parser)."""
    return [child for child in psutil.Process(fleet.server.pid).children()
            if is_worker(child)]


def is_worker(process: psutil.Process) -> bool:
    try:
        return "--worker-index" in process.cmdline()
    except psutil.Error:  # it has just ended
        return False


def test_a_worker_that_dies_is_started_again(fleet: Fleet) -> None:
    # One that dies sooner after its start stops the whole server instead (a crash loop).
    Api(fleet.url, fleet.admin).wait_for("workers past CRASH_LOOP_SECONDS", lambda: min(
        time.time() - p.create_time() for p in workers_of(fleet)) > CRASH_LOOP_SECONDS + 1,
        CRASH_LOOP_SECONDS + 30, 0.5)
    first = {p.pid for p in workers_of(fleet)}
    assert len(first) == 2
    os.kill(min(first), signal.SIGKILL)
    Api(fleet.url, fleet.admin).wait_for("a new worker", lambda: len(
        {p.pid for p in workers_of(fleet)} - first) == 1 and
        len(workers_of(fleet)) == 2, 30, 0.2)
    _, key = new_key(fleet, "after")
    Api(fleet.url, fleet.admin).wait_for("20 answers in a row", lambda: [
        ask(fleet, key).status_code for _ in range(20)] == [200] * 20, 30, 0.5)


def test_the_workers_of_a_killed_server_end_too(fleet: Fleet) -> None:
    # A second server on the same database and Redis, supervising only.
    second, _ = start_server(fleet.env, free_port(), "--workers", "2", "--no-controllers")
    workers = [child for child in psutil.Process(second.pid).children() if is_worker(child)]
    assert len(workers) == 2
    second.kill()
    second.wait(timeout=10)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [] and len(gone) == 2


def test_sigterm_stops_the_server_and_every_worker(fleet: Fleet) -> None:
    children = psutil.Process(fleet.server.pid).children(recursive=True)
    assert len(workers_of(fleet)) == 2
    fleet.server.send_signal(signal.SIGTERM)
    assert fleet.server.wait(timeout=30) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [] and len(gone) == len(children)


def test_more_than_one_worker_without_redis_is_refused_with_a_reason(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    env = server_env(tmp_path_factory.mktemp("no-redis"))
    failed = subprocess.run([sys.executable, "manage.py", "serve", "--workers", "2",
                             "--port", str(free_port())], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "--workers above 1 needs REDIS_URL" in failed.stderr


@pytest.mark.parametrize("count", ["0", "257"])
def test_a_worker_count_out_of_range_is_refused(tmp_path_factory: pytest.TempPathFactory,
                                                count: str) -> None:
    env = server_env(tmp_path_factory.mktemp("bad-count"), REDIS_URL="redis://127.0.0.1:6379/9")
    failed = subprocess.run([sys.executable, "manage.py", "serve", "--workers", count,
                             "--port", str(free_port())], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "--workers: a whole number from 1 to 256" in failed.stderr
