"""A PostgreSQL outage under `manage.py serve` (gateway and controllers in one process) on
a private PostgreSQL cluster (tests/services.py), with two local replicas (FAKE engines:
fakes/vllm_cli.py stands in for vLLM's command line). The real server is stopped while
requests flow, and started again.

While it is away the gateway serves known keys and routes from its caches, keeps the usage
records (shown on /metrics), refuses keys it cannot check with 503, and the controllers
pause without dying. Once it is back every request made has exactly one usage record and
is counted once in its key's totals, and the deployment has the same two replicas."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import psycopg
import pytest

from fakes.vllm_cli import stand_in_python
from tests.processes import (
    Api,
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
)
from tests.services import PrivatePostgres, private_postgres

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
    process: subprocess.Popen[str]
    database: PrivatePostgres
    env: dict[str, str]
    key: str  # an inference key, used before the outage (so cached)


@pytest.fixture
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    base = tmp_path_factory.mktemp("postgres-outage")
    python = stand_in_python(base)
    with private_postgres() as database:
        env = server_env(base / "data", DATABASE_URL=database.url,
                          LOCAL_BACKEND_PYTHONS=python, USAGE_FLUSH_SECONDS=str(FLUSH_SECONDS),
                          RECONCILE_INTERVAL_SECONDS="0.3", HEALTH_CHECK_SECONDS="1",
                          STOP_GRACE_SECONDS="2")
        manage(env, "migrate", "--noinput", "-v0")
        weights = base / "weights"
        weights.mkdir()
        manage(env, "shell", "-c", "from tests.factories import make_model; "
                                   f"make_model('fake', path={str(weights)!r})")
        admin = manage(env, "create_api_key", "--name", "admin", "--scope",
                       "admin").stdout.strip().splitlines()[-1]
        key = manage(env, "create_api_key", "--name", "app").stdout.strip().splitlines()[-1]
        port = free_port()
        process, _ = start_server(env, port)
        api = Api(f"http://127.0.0.1:{port}", admin)
        try:
            assert api.post("/api/v1/backends/", {"name": "fakes", "kind": "local",
                                                  "config": {"python": python}}
                            ).status_code == 201
            assert api.post("/api/v1/deployments/", {"name": "chat", "model": "fake",
                                                     "backend": "fakes", "replicas": 2}
                            ).status_code == 201
            api.wait_for("two replicas ready", lambda: api.get(
                "/api/v1/deployments/chat/")["ready_replicas"] == 2, 60, 0.2)
            yield Serve(api.url, process, database, env, key)
        finally:
            if not database.running():
                database.start()
            stop_server(process)
            end_replicas(env["DATA_DIR"])


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


def traffic(serve: Serve, count: int) -> int:
    """`count` requests, streamed and not, four at a time; how many were answered."""
    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(lambda n: ask(serve, n, stream=n % 2 == 0), range(count)))


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


def test_a_postgres_outage_loses_no_usage_record_and_the_controllers_resume(
        serve: Serve) -> None:
    dropped = metric(serve, "fleetplane_gateway_usage_records_dropped_total")
    made = traffic(serve, 10)
    wait_for("the first records written", lambda: query(
        serve, "SELECT count(*) FROM serving_usagerecord")[0] == made, 15)
    rows_before, processes_before = replicas(serve)
    assert rows_before == (2, 2) and len(processes_before) == 2

    serve.database.stop()
    # Known key, known routes: all answered, over several health intervals (1 s) and
    # many of the controllers' failing passes (every 0.3 s).
    outage_began, during = time.monotonic(), 0
    while time.monotonic() - outage_began < OUTAGE_SECONDS:
        during += traffic(serve, 10)
    made += during
    assert metric(serve, "fleetplane_gateway_usage_records_buffered") == during
    unknown = httpx.post(f"{serve.url}/v1/completions", timeout=30,
                         headers={"Authorization": "Bearer fp-" + "x" * 43},
                         json={"model": "chat", "prompt": "hi"})
    # A key no cache vouches for cannot be checked: refused, never served unchecked.
    assert unknown.status_code == 503, unknown.text
    assert unknown.json()["error"]["code"] == "keys_unavailable"
    assert httpx.get(f"{serve.url}/livez", timeout=10).status_code == 200
    # Ready, degraded: it serves the keys and routes it holds.
    assert httpx.get(f"{serve.url}/readyz", timeout=10).json()["status"] == "degraded"
    # The controllers' passes failed meanwhile (every 0.3 s): the process lives on and
    # neither starts nor stops a replica it cannot record.
    assert serve.process.poll() is None
    assert processes(serve) == processes_before

    serve.database.start()
    made += traffic(serve, 5)
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
    wait_for("the database answering the server", lambda: httpx.get(
        f"{serve.url}/readyz", timeout=10).json()["status"] == "ok", REPLICAS_BOUND_SECONDS)
    rows_after, processes_after = replicas(serve)
    assert rows_after == (2, 2)
    assert processes_after == processes_before
    assert serve.process.poll() is None

