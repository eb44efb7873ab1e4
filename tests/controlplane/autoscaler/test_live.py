"""Warm standby and scale to zero, end to end: `manage.py serve` (reconciler, collector,
autoscaler, gateway in one process) with the local backend running FAKE engines
(fakes/vllm_cli.py stands in for vLLM's command line: many replicas start in a second).

The same paths with the real vLLM server are measured by bench/autoscale.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fakes.vllm_cli import stand_in_python
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

IDLE = {"idle_seconds": 10, "scale_down_window_seconds": 0, "cooldown_seconds": 0}
LOGINS: dict[str, tuple[str, str]] = {}  # the plane's url -> the admin login it printed


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    base = tmp_path_factory.mktemp("autoscaling")
    python = stand_in_python(base)
    env = server_env(base / "data", LOCAL_BACKEND_PYTHONS=python,
                      RECONCILE_INTERVAL_SECONDS="0.3",
                      HEALTH_CHECK_SECONDS="1", SCRAPE_INTERVAL="0.5", SCRAPE_TIMEOUT="0.4",
                      DRAIN_TIMEOUT_SECONDS="1", STOP_GRACE_SECONDS="2")
    manage(env, "migrate", "--noinput", "-v0")
    weights = base / "weights"
    weights.mkdir()
    manage(env, "shell", "-c", "from tests.factories import make_model; "
                               f"make_model('fake', path={str(weights)!r})")
    key = manage(env, "create_api_key", "--name", "tests", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    port = free_port()
    process, output = start_server(env, port)
    api = Api(f"http://127.0.0.1:{port}", key)
    LOGINS[api.url] = login_from(output)
    response = api.post("/api/v1/backends/", {"name": "fakes", "kind": "local", "config": {
        "python": python}})
    assert response.status_code == 201, response.text
    try:
        yield api
    finally:
        stop_server(process)
        end_replicas(env["DATA_DIR"])


def deploy(api: Api, name: str, **spec: Any) -> None:
    response = api.post("/api/v1/deployments/", {"name": name, "model": "fake",
                                                 "backend": "fakes", **spec})
    assert response.status_code == 201, response.text


def roles(api: Api, name: str) -> list[tuple[str, str, str, int | None]]:
    replicas = api.get(f"/api/v1/deployments/{name}/")["replica_list"]
    return sorted((r["name"], r["phase"], r["role"], r["pid"]) for r in replicas)


def ready(api: Api, name: str, active: int, standby: int) -> Any:
    def check() -> Any:
        seen = roles(api, name)
        counts = (sum(1 for _, p, r, _ in seen if p == "ready" and r == "active"),
                  sum(1 for _, p, r, _ in seen if p == "ready" and r == "standby"))
        return seen if counts == (active, standby) and len(seen) == active + standby else None

    return api.wait_for(f"{name}: {active} active and {standby} standby", check, 60, 0.2)


def chat(api: Api, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/chat/completions", headers={
        "Authorization": f"Bearer {api.key}"}, timeout=timeout, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})


def test_a_scale_up_promotes_the_standby_at_once_then_refills_it(plane: Api) -> None:
    deploy(plane, "pool", replicas=1, standby=1, max_replicas=3)
    before = ready(plane, "pool", 1, 1)
    [standby] = [r for r in before if r[2] == "standby"]
    started = time.monotonic()
    response = plane.post("/api/v1/deployments/pool/scale/", {"replicas": 2})
    assert response.status_code == 200, response.text

    def promoted() -> bool:
        return any(r[0] == standby[0] and r[2] == "active" for r in roles(plane, "pool"))

    plane.wait_for("the standby promoted", promoted, 10, 0.05)
    took = time.monotonic() - started
    assert took < 1.0, f"promotion took {took:.2f} s"
    after = {r[0]: r for r in roles(plane, "pool")}
    assert after[standby[0]][3] == standby[3]  # the same process: nothing restarted
    assert chat(plane, "pool").status_code == 200
    final = ready(plane, "pool", 2, 1)  # a new standby refilled the pool
    assert len({r[0] for r in final} - {r[0] for r in before}) == 1


def test_idle_goes_to_zero_and_a_request_wakes_it(plane: Api) -> None:
    deploy(plane, "sleepy", replicas=1, min_replicas=0, max_replicas=1,
           autoscaling=IDLE)
    ready(plane, "sleepy", 1, 0)
    plane.wait_for("scaled to zero", lambda: plane.get(
        "/api/v1/deployments/sleepy/")["replicas"] == 0 and not roles(plane, "sleepy"),
        40, 0.5)
    started = time.monotonic()
    response = chat(plane, "sleepy")  # waits at the gateway while a replica starts
    took = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    events = plane.get("/api/v1/events/", deployment="sleepy")
    messages = [e["message"] for e in (events.get("results", events))]
    assert any("idle for" in m for m in messages)
    assert any("waking: 1 request(s) waiting at the gateway" in m for m in messages)
    assert took < 30


def test_with_a_standby_a_request_at_zero_is_served_at_once(plane: Api) -> None:
    deploy(plane, "warm", replicas=1, min_replicas=0, max_replicas=1, standby=1,
           autoscaling=IDLE)
    ready(plane, "warm", 1, 1)
    plane.wait_for("no active replica, the standby kept", lambda: (
        plane.get("/api/v1/deployments/warm/")["replicas"] == 0
        and [r[2] for r in roles(plane, "warm")] == ["standby"]), 40, 0.5)
    started = time.monotonic()
    response = chat(plane, "warm")
    took = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert took < 1.5, f"served {took:.2f} s after the request"


@pytest.mark.browser
def test_the_dashboard_charts_and_lists_every_decision_with_its_inputs(
        plane: Api, browser: Any) -> None:
    deploy(plane, "watched", replicas=1, min_replicas=1, max_replicas=2, autoscaling={
        "signals": [{"name": "waiting_per_replica", "target": 4}]})
    ready(plane, "watched", 1, 0)
    username, password = LOGINS[plane.url]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(plane.url + "/login/?next=/dashboard/watched/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_selector("#live-status.ready")
    # Idle fake engines: every pass decides "steady", and each decision shows up.
    page.wait_for_function("document.querySelectorAll('#decisions tbody tr').length >= 2",
                           timeout=20_000)
    row = page.locator("#decisions tbody tr").first.locator("td")
    assert row.nth(1).inner_text() == "1 → 1"
    assert row.nth(2).inner_text() == "steady"
    assert row.nth(3).inner_text() == "waiting_per_replica 0.00 / 4.00 → 0"
    chart = page.locator("#chart-signals")
    assert chart.get_attribute("data-series") == "1"
    # Nothing waiting: 0 of the target (the newest pass's decision follows its figures).
    page.wait_for_function("document.querySelector('#chart-signals').dataset.last === '0'",
                           timeout=10_000)
    page.close()
