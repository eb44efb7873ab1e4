"""A PostgreSQL outage under traffic, on a private PostgreSQL cluster (tests/services.py),
with two local replicas (FAKE engines: fakes/vllm_cli.py stands in for vLLM's command
line), in both shapes of the product: `manage.py serve` with the controllers in the same
process, and scale-out (`serve --no-controllers` beside `run_controllers --health-port`,
sharing a private Redis). The real server is stopped while requests flow, and started
again while they still do.

While it is away the gateway serves known keys and routes from its caches (no request
fails), keeps the usage records (shown on /metrics), refuses keys it cannot check with 503,
stays live and ready (degraded), and the controllers pause without dying. Once it is back
every request made has exactly one usage record and is counted once in its key's totals,
and the deployment has the same two replica servers."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import psycopg
import pytest

from fakes.vllm_cli import stand_in_python
from tests.processes import (
    ROOT,
    Api,
    create_key,
    end_replicas,
    free_port,
    manage,
    register_fake_model,
    server_env,
    start_server,
    stop_server,
)
from tests.services import PrivatePostgres, private_postgres, private_redis

pytestmark = pytest.mark.slow

FLUSH_SECONDS = 0.2  # USAGE_FLUSH_SECONDS: the writer's backoff tops out at 64x this
# Once the database is back: the writer's next try (at most 12.8 s after its last) and
# the controllers' next pass; the bounds asserted leave room for a busy machine.
WRITTEN_BOUND_SECONDS = 45.0
REPLICAS_BOUND_SECONDS = 30.0
OUTAGE_SECONDS = 5.0  # of traffic while the database is away


@dataclass
class Serve:
    url: str
    processes: list[subprocess.Popen[Any]]  # the product's: none may die
    database: PrivatePostgres
    env: dict[str, str]
    key: str  # an inference key, used before the outage (so cached)
    controller_health: str = ""  # run_controllers' /livez, in scale-out


def start_fleet(env: dict[str, str], scale_out: bool
                ) -> tuple[list[subprocess.Popen[Any]], str, str]:
    """The product's processes; their gateway's URL and run_controllers' health URL."""
    port = free_port()
    if not scale_out:
        return [start_server(env, port)[0]], f"http://127.0.0.1:{port}", ""
    health = free_port()
    controllers = subprocess.Popen([sys.executable, "manage.py", "run_controllers",
                                    "--health-port", str(health), "--health-host",
                                    "127.0.0.1"], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL)
    gateway = start_server(env, port, "--no-controllers")[0]
    return [gateway, controllers], f"http://127.0.0.1:{port}", f"http://127.0.0.1:{health}"


@pytest.fixture(params=["serve", "scale-out"])
def serve(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Serve]:
    base = tmp_path_factory.mktemp("postgres-outage")
    python = stand_in_python(base)
    with private_postgres() as database, private_redis() as redis_server:
        env = server_env(base / "data", DATABASE_URL=database.url,
                          LOCAL_BACKEND_PYTHONS=python, USAGE_FLUSH_SECONDS=str(FLUSH_SECONDS),
                          RECONCILE_INTERVAL_SECONDS="0.3", HEALTH_CHECK_SECONDS="1",
                          GATEWAY_LOAD_SCRAPE_SECONDS="0.2", STOP_GRACE_SECONDS="2")
        if request.param == "scale-out":
            env["REDIS_URL"] = redis_server.url
        manage(env, "migrate", "--noinput", "-v0")
        register_fake_model(env, base)
        admin = create_key(env, "admin", "--scope", "admin")
        key = create_key(env, "app")
        processes, url, health = start_fleet(env, request.param == "scale-out")
        api = Api(url, admin)
        try:
            assert api.post("/api/v1/backends/", {"name": "fakes", "kind": "local",
                                                  "config": {"python": python}}
                            ).status_code == 201
            assert api.post("/api/v1/deployments/", {"name": "chat", "model": "fake",
                                                     "backend": "fakes", "replicas": 2}
                            ).status_code == 201
            api.wait_for("two replicas routed", lambda: any(
                m["id"] == "chat" and m["ready_replicas"] == 2
                for m in api.get("/v1/models")["data"]), 60, 0.2)
            yield Serve(url, processes, database, env, key, health)
        finally:
            if not database.running():
                database.start()
            for process in processes:
                if isinstance(process.args, list) and "run_controllers" in process.args:
                    process.terminate()
                    process.wait(timeout=30)
                else:
                    stop_server(process)
            end_replicas(env["DATA_DIR"])


@dataclass
class Traffic:
    """Requests four at a time, streamed and not, until stopped; what each came to."""

    serve: Serve
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=60)

    def run(self) -> None:
        with ThreadPoolExecutor(4) as pool:
            n = 0
            while not self.stop.is_set():
                for outcome in pool.map(self.one, range(n, n + 4)):
                    if outcome:
                        self.failures.append(outcome)
                    else:
                        self.answered += 1
                n += 4

    def one(self, n: int) -> str:
        try:
            ask(self.serve, n, stream=n % 2 == 0)
        except Exception as error:  # told in the assertion, with what went wrong
            return f"request {n}: {error!r}"
        return ""

    def wait_for_more(self, count: int, seconds: float = 60) -> None:
        target = self.answered + count
        wait_for(f"{count} more answers", lambda: self.answered >= target or self.failures,
                 seconds)
        assert not self.failures, self.failures


def ask(serve: Serve, n: int, stream: bool) -> int:
    """One completion with the official client; returns 1 once answered."""
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=serve.key, max_retries=0,
                           timeout=30)
    if stream:
        chunks = list(client.completions.create(model="chat", prompt=f"hi {n}",
                                                max_tokens=4, stream=True))
        assert chunks
    else:
        assert client.completions.create(model="chat", prompt=f"hi {n}",
                                         max_tokens=4).choices
    return 1


def metric(serve: Serve, name: str) -> float:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not on /metrics"
    return float(match.group(1))


def query(serve: Serve, sql: str) -> Any:
    with psycopg.connect(serve.database.url) as connection:
        return connection.execute(sql).fetchone()


def processes(serve: Serve) -> set[str]:
    """The replicas whose processes run."""
    from controlplane.backends.local import owned_processes

    return {name for _, name in owned_processes(serve.env["DATA_DIR"])}


def replicas(serve: Serve) -> tuple[Any, set[str]]:
    """The deployment's replica rows (count, ready) and its running replica processes."""
    rows = query(serve, "SELECT count(*), count(*) FILTER (WHERE r.phase = 'ready') "
                        "FROM controlplane_replica r JOIN controlplane_deployment d "
                        "ON r.deployment_id = d.id WHERE d.name = 'chat'")
    return tuple(rows), processes(serve)


def wait_for(what: str, check: Any, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if check():
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {seconds:.0f} s")


def alive(serve: Serve) -> bool:
    return (all(process.poll() is None for process in serve.processes)
            and httpx.get(f"{serve.url}/livez", timeout=10).status_code == 200
            and (not serve.controller_health or httpx.get(
                f"{serve.controller_health}/livez", timeout=10).status_code == 200))


def test_a_postgres_outage_loses_no_usage_record_and_the_controllers_resume(
        serve: Serve) -> None:
    dropped = metric(serve, "fleetplane_gateway_usage_records_dropped_total")
    rows_before, processes_before = replicas(serve)
    assert rows_before == (2, 2) and len(processes_before) == 2
    with Traffic(serve) as traffic:
        traffic.wait_for_more(12)
        serve.database.stop()
        outage_began = time.monotonic()
        # Known key, known routes: every request answered, over several health
        # intervals (1 s) and many of the controllers' failing passes (every 0.3 s).
        wait_for("the outage's traffic", lambda: time.monotonic() - outage_began
                 >= OUTAGE_SECONDS or traffic.failures, 2 * OUTAGE_SECONDS)
        traffic.wait_for_more(20)
        assert metric(serve, "fleetplane_gateway_usage_records_buffered") > 0
        unknown = httpx.post(f"{serve.url}/v1/completions", timeout=30,
                             headers={"Authorization": "Bearer fp-" + "x" * 43},
                             json={"model": "chat", "prompt": "hi"})
        # A key no cache vouches for cannot be checked: refused, never served unchecked.
        assert unknown.status_code == 503, unknown.text
        assert unknown.json()["error"]["code"] == "keys_unavailable"
        # Ready, degraded: it serves the keys and routes it holds.
        assert httpx.get(f"{serve.url}/readyz", timeout=10).json()["status"] == "degraded"
        # The controllers' passes failed meanwhile: every process lives on, and no
        # replica was started or stopped that could not be recorded.
        assert alive(serve)
        assert processes(serve) == processes_before
        serve.database.start()
        traffic.wait_for_more(12)
    assert not traffic.failures, traffic.failures
    made = traffic.answered
    wait_for("every request recorded", lambda: query(
        serve, "SELECT count(*) FROM serving_usagerecord")[0] == made,
        WRITTEN_BOUND_SECONDS)
    assert query(serve, "SELECT count(DISTINCT record_id), count(DISTINCT request_id) "
                        "FROM serving_usagerecord") == (made, made)
    assert query(serve, "SELECT requests_total FROM serving_apikey "
                        "WHERE name = 'app'") == (made,)
    assert metric(serve, "fleetplane_gateway_usage_records_buffered") == 0
    assert metric(serve, "fleetplane_gateway_usage_records_dropped_total") == dropped
    # The controllers resumed with the same two replicas: none lost, none doubled.
    wait_for("the database answering the gateway", lambda: httpx.get(
        f"{serve.url}/readyz", timeout=10).json()["status"] == "ok", REPLICAS_BOUND_SECONDS)
    wait_for("the replicas seen ready again", lambda: replicas(serve) == (
        (2, 2), processes_before), REPLICAS_BOUND_SECONDS)
    assert alive(serve)
