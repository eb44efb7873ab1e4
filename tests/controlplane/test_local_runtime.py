"""Deployments on the local runtime with the real vLLM CPU server and the real demo model:
the control plane runs as `manage.py serve`, driven through its REST API and pages.

The tests in this module build on each other in order (one running control plane and its
replicas are shared, because each vLLM start costs tens of seconds on two cores).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from controlplane.backends.local import owned_processes
from tests.processes import (
    Api,
    end_replicas,
    free_port,
    login_from,
    manage,
    server_env,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow

READY_TIMEOUT = 600
ENGINE_ARGS = {"max_model_len": 1024, "extra_args": ["--enforce-eager"]}


@dataclass
class ControlPlane:
    api: Api
    env: dict[str, str]
    port: int
    process: Any
    username: str
    password: str
    inference_key: str

    def restart(self) -> None:
        self.process, _ = start_server(self.env, self.port)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory,
          demo_model_folder: Path) -> Iterator[ControlPlane]:
    data = tmp_path_factory.mktemp("runtime") / "data"
    env = server_env(data, RECONCILE_INTERVAL_SECONDS="0.5", HEALTH_CHECK_SECONDS="1",
                      RESTART_BACKOFF_BASE_SECONDS="1", RESTART_BACKOFF_MAX_SECONDS="8",
                      DRAIN_TIMEOUT_SECONDS="5", STOP_GRACE_SECONDS="5",
                      LOCAL_KV_CACHE_GIB="1",
                      MODEL_IMPORT_ROOTS=str(demo_model_folder.parent))
    manage(env, "migrate", "--noinput", "-v0")
    manage(env, "register_model", "smollm2", "--source", "local", "--path",
           str(demo_model_folder))
    key = manage(env, "create_api_key", "--name", "tests", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    inference_key = manage(env, "create_api_key", "--name", "app").stdout.strip(
        ).splitlines()[-1]
    port = free_port()
    process, output = start_server(env, port)
    username, password = login_from(output)
    plane = ControlPlane(Api(f"http://127.0.0.1:{port}", key), env, port, process, username,
                         password, inference_key)
    try:
        yield plane
    finally:
        plane.api.post("/api/v1/deployments/demo/scale/", {"replicas": 0})
        stop_server(plane.process)
        end_replicas(plane.env["DATA_DIR"])


def replica_processes(plane: ControlPlane) -> list[psutil.Process]:
    """Processes the local backend of this control plane started (every one of them, the
    API server and vLLM's engine processes, carries the replica markers)."""
    return [process for process, _ in owned_processes(plane.env["DATA_DIR"])]


def replicas(api: Api, deployment: str = "demo") -> list[dict[str, Any]]:
    return list(api.get("/api/v1/replicas/", deployment=deployment)["results"])


def ready_replicas(api: Api, count: int, deployment: str = "demo") -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        current = replicas(api, deployment)
        ready = [r for r in current if r["phase"] == "ready"]
        return ready if len(ready) == count and len(current) == count else None

    return list(api.wait_for(f"{count} ready replica(s) of {deployment}", check,
                             READY_TIMEOUT))


def engine_key(replica: dict[str, Any]) -> str:
    """The key a replica demands, read where only its own user can read it (the process's
    environment): the API and the pages never show it."""
    return str(psutil.Process(replica["pid"]).environ()["VLLM_API_KEY"])


def complete(replica: dict[str, Any], tokens: int = 30, key: str = "") -> dict[str, Any]:
    response = httpx.post(f"{replica['endpoint']}/v1/completions", timeout=120, json={
        "model": "demo", "prompt": "The capital of France is", "max_tokens": tokens,
        # Exactly `tokens` tokens, whatever the model says (an end-of-text token would stop
        # it early, and where it comes depends on the CPU's numerics).
        "temperature": 0, "ignore_eos": True},
        headers={"Authorization": f"Bearer {key or engine_key(replica)}"})
    response.raise_for_status()
    return dict(response.json())


def test_a_deployment_becomes_a_ready_replica_that_answers(plane: ControlPlane) -> None:
    response = plane.api.post("/api/v1/deployments/", {
        "name": "demo", "model": "smollm2", "replicas": 1, "max_replicas": 2,
        "engine_args": {**ENGINE_ARGS, "served_model_name": "demo"}})
    assert response.status_code == 201, response.text
    [replica] = ready_replicas(plane.api, 1)
    assert replica["time_to_ready_seconds"] > 0
    models = httpx.get(f"{replica['endpoint']}/v1/models", timeout=10, headers={
        "Authorization": f"Bearer {engine_key(replica)}"}).json()
    assert models["data"][0]["id"] == "demo"
    answer = complete(replica)
    assert answer["usage"]["completion_tokens"] == 30
    deployment = plane.api.get("/api/v1/deployments/demo/")
    assert deployment["ready_replicas"] == 1
    assert {c["type"]: c["status"] for c in deployment["conditions"]}["Available"] == "True"
    logs = plane.api.get(f"/api/v1/replicas/{replica['name']}/logs/", lines=500)["lines"]
    assert any("vllm.entrypoints.openai.api_server" in line for line in logs)
    actions = [e["action"] for e in plane.api.get("/api/v1/deployments/demo/events/")["results"]]
    assert "replica-ready" in actions


def test_a_replica_refuses_a_request_without_its_key_and_the_gateway_still_serves(
    plane: ControlPlane,
) -> None:
    [replica] = ready_replicas(plane.api, 1)
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    refused = httpx.post(f"{replica['endpoint']}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 401
    assert refused.json() == {"error": "Unauthorized"}
    wrong = httpx.post(f"{replica['endpoint']}/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401
    # Nor on the paths vLLM's own key check leaves open: SageMaker's /invocations runs a
    # chat completion, /tokenize reads the tokenizer. Liveness stays open.
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 3}
    for path, payload in (("/invocations", chat), ("/tokenize", {"prompt": "Hello"})):
        closed = httpx.post(f"{replica['endpoint']}{path}", json=payload, timeout=30)
        assert (path, closed.status_code) == (path, 401)
        assert closed.json() == {"error": "Unauthorized"}
    assert httpx.get(f"{replica['endpoint']}/health", timeout=30).status_code == 200
    through = httpx.post(f"{plane.api.url}/v1/completions", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {plane.inference_key}"})
    assert through.status_code == 200, through.text
    assert through.json()["usage"]["completion_tokens"] == 3
    # The key is nowhere a person with an admin key or the console sees it.
    key = engine_key(replica)
    for path in ("/api/v1/deployments/demo/", "/api/v1/deployments/demo/events/",
                 f"/api/v1/replicas/{replica['name']}/",
                 f"/api/v1/replicas/{replica['name']}/logs/"):
        assert key not in httpx.get(f"{plane.api.url}{path}", timeout=10, headers={
            "Authorization": f"Bearer {plane.api.key}"}).text, path
    # Nor on the command line every local user can read.
    assert not any(key in part for part in psutil.Process(replica["pid"]).cmdline())


def test_the_deployment_page_shows_replicas_time_to_ready_logs_and_events(
    plane: ControlPlane, browser: Any
) -> None:
    page = browser.new_page()
    page.goto(f"{plane.api.url}/login/")
    page.fill("input[name=username]", plane.username)
    page.fill("input[name=password]", plane.password)
    page.click("button[type=submit]")
    page.goto(f"{plane.api.url}/deployments/demo/")
    row = page.locator("#replicas tbody tr").first
    assert row.get_attribute("data-phase") == "ready"
    assert row.locator("td.ttr").inner_text().endswith(" s")
    page.wait_for_function("document.getElementById('logs').textContent.length > 100")
    assert "replica-ready" in page.locator("#events").inner_text()
    page.close()


def test_killing_a_replica_under_load_replaces_it(plane: ControlPlane) -> None:
    [replica] = replicas(plane.api)
    key = engine_key(replica)  # read before the process is killed
    stop = threading.Event()
    outcomes: list[str] = []

    def load() -> None:
        while not stop.is_set():
            try:
                complete(replica, tokens=64, key=key)
                outcomes.append("ok")
            except httpx.HTTPError:
                outcomes.append("error")
                time.sleep(0.2)  # pacing the client: retry a refused request gently

    workers = [threading.Thread(target=load) for _ in range(4)]
    for worker in workers:
        worker.start()
    # Killed only once the replica has answered under this load (a slow machine needs
    # several seconds for the first 64-token answers).
    plane.api.wait_for("an answer under load", lambda: "ok" in outcomes, 120, 0.2)
    os.kill(replica["pid"], signal.SIGKILL)
    try:
        [again] = plane.api.wait_for("a restarted replica", lambda: [
            r for r in replicas(plane.api) if r["phase"] == "ready" and r["restart_count"] == 1
        ], READY_TIMEOUT)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=130)
    assert again["pid"] != replica["pid"]
    assert "ok" in outcomes and "error" in outcomes
    assert complete(again)["usage"]["completion_tokens"] == 30
    events = plane.api.get("/api/v1/deployments/demo/events/")["results"]
    crash = next(e for e in events if e["action"] == "replica-crashed")
    assert "exited" in crash["message"]


def test_scaling_to_two_adds_a_second_ready_replica(plane: ControlPlane) -> None:
    response = plane.api.post("/api/v1/deployments/demo/scale/", {"replicas": 2})
    assert response.status_code == 200
    both = ready_replicas(plane.api, 2)
    assert len({r["endpoint"] for r in both}) == 2
    for replica in both:
        assert complete(replica, tokens=5)["usage"]["completion_tokens"] == 5


def test_a_killed_control_plane_leaves_replicas_serving_and_adopts_them(
    plane: ControlPlane,
) -> None:
    before = {r["name"]: r for r in replicas(plane.api)}
    plane.process.kill()
    plane.process.wait(timeout=15)
    for replica in before.values():
        assert complete(replica, tokens=3)["usage"]["completion_tokens"] == 3
    plane.restart()

    def adoptions() -> list[dict[str, Any]] | None:
        events = [e for e in plane.api.get("/api/v1/deployments/demo/events/")["results"]
                  if e["action"] == "replica-adopted"]
        return events if len(events) >= 2 else None

    adopted = plane.api.wait_for("adoption events", adoptions, 30)
    assert {e["replica_name"] for e in adopted} == set(before)
    after = {r["name"]: r for r in replicas(plane.api)}
    assert {name: (r["pid"], r["restart_count"]) for name, r in after.items()} == {
        name: (r["pid"], r["restart_count"]) for name, r in before.items()}
    assert all(r["phase"] == "ready" for r in after.values())


def test_scaling_to_zero_drains_and_leaves_no_process(plane: ControlPlane) -> None:
    pids = [r["pid"] for r in replicas(plane.api)]
    response = plane.api.post("/api/v1/deployments/demo/scale/", {"replicas": 0})
    assert response.status_code == 200
    plane.api.wait_for("no replicas", lambda: replicas(plane.api) == [], 120)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() !=
                   psutil.STATUS_ZOMBIE for pid in pids)
    assert [p.pid for p in replica_processes(plane)] == []
    actions = [e["action"] for e in plane.api.get("/api/v1/deployments/demo/events/")["results"]]
    assert actions.count("replica-stopped") == 2


def test_a_replica_that_cannot_start_fails_with_its_log_and_backs_off(
    plane: ControlPlane,
) -> None:
    # The demo model is not AWQ-quantized: vLLM refuses these args at start-up.
    response = plane.api.post("/api/v1/deployments/", {
        "name": "broken", "model": "smollm2", "replicas": 1,
        "engine_args": {**ENGINE_ARGS, "quantization": "awq"}})
    assert response.status_code == 201, response.text

    def failed_three_times() -> list[dict[str, Any]] | None:
        # Repeated crashes are one event with a count (the audit log coalesces them).
        events = [e for e in plane.api.get("/api/v1/deployments/broken/events/")["results"]
                  if e["action"] == "replica-crashed"]
        return events if sum(e["count"] for e in events) >= 3 else None

    crashes = plane.api.wait_for("three failed starts", failed_three_times, 300, 2)
    latest = crashes[0]["message"]  # newest first; it keeps the latest wording
    restart, delay = latest.rsplit("restart ", 1)[1].split(" in ")
    # The backoff doubles from the base (1 s here) with each restart, up to 8 s.
    assert int(restart) >= 3 and int(delay.split()[0]) == min(2 ** (int(restart) - 1), 8)
    assert "last log lines" in latest
    deployment = plane.api.get("/api/v1/deployments/broken/")
    degraded = {c["type"]: c for c in deployment["conditions"]}["Degraded"]
    assert degraded["status"] == "True"
    assert "awq" in degraded["message"].lower()
    plane.api.post("/api/v1/deployments/broken/stop/")
    plane.api.wait_for("no broken replicas", lambda: replicas(plane.api, "broken") == [], 120)
    assert [p.pid for p in replica_processes(plane)] == []
