"""The fleet dashboard with more deployments than it shows, in headless Chromium against
`manage.py serve`: the busiest 50 and the fleet's totals arrive whole, then the socket
sends only what changed, and a deployment that gets busy enters the table at the top.
Its replicas are FAKE engines (fakes/engine.py) and endpoints that refuse."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.engines import FakeEngine, start_fake_engine
from tests.processes import (
    Api,
    create_key,
    end_replicas,
    free_port,
    login_from,
    manage,
    register_fake_model,
    server_env,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.browser]

IDLE = 55  # more than the dashboard's 50 rows
BUSY = "zz-fleet-busy"  # last by name: outside the first view until it has load


@dataclass
class Served:
    url: str
    username: str
    password: str
    key: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("fleet-dashboard")
    env = server_env(folder / "data", SCRAPE_INTERVAL="1")
    manage(env, "migrate", "--noinput", "-v0")
    register_fake_model(env, folder)
    admin = create_key(env, "admin", "--scope", "admin")
    key = create_key(env, "load", "--scope", "inference")
    engine: FakeEngine = start_fake_engine("fleet-busy", model=BUSY)
    port = free_port()
    process, output = start_server(env, port)
    url = f"http://127.0.0.1:{port}"
    api = Api(url, admin)
    try:
        for name, endpoint in (("fleet-nowhere", f"http://127.0.0.1:{free_port()}"),
                               ("fleet-busy-endpoint", engine.url)):
            assert api.post("/api/v1/backends/", {"name": name, "kind": "external",
                                                  "config": {"url": endpoint}}).is_success
        for number in range(IDLE):
            assert api.post("/api/v1/deployments/", {
                "name": f"fleet-idle-{number:02d}", "model": "fake",
                "backend": "fleet-nowhere"}).is_success
        assert api.post("/api/v1/deployments/", {"name": BUSY, "model": "fake",
                                                 "backend": "fleet-busy-endpoint"}).is_success
        api.wait_for("the busy deployment routed", lambda: any(
            m["id"] == BUSY and m["ready_replicas"]
            for m in Api(url, key).get("/v1/models")["data"]), 60, 0.5)
        yield Served(url, *login_from(output), key)
    finally:
        stop_server(process)
        engine.process.kill()
        engine.process.wait(timeout=10)
        end_replicas(env["DATA_DIR"])


def load(served: Served, stop: threading.Event) -> None:
    while not stop.is_set():
        httpx.post(f"{served.url}/v1/completions", timeout=30,
                   headers={"Authorization": f"Bearer {served.key}"},
                   json={"model": BUSY, "prompt": "hello", "max_tokens": 8})


def test_the_fleet_dashboard_shows_the_busiest_and_applies_what_changed(
        browser: Any, served: Served) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{served.url}/login/?next=/dashboard/")
    page.fill("input[name=username]", served.username)
    page.fill("input[name=password]", served.password)
    page.click("button[type=submit]")
    page.wait_for_url(served.url + "/dashboard/")
    page.wait_for_function("() => document.querySelectorAll('#fleet tr[data-deployment]')"
                           ".length === 50", timeout=30_000)
    assert page.locator(f'#fleet tr[data-deployment="{BUSY}"]').count() == 0
    assert page.locator("#fleet-totals").inner_text().startswith(f"{IDLE + 1} deployments")
    stop = threading.Event()
    workers = [threading.Thread(target=load, args=(served, stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        # A delta brings it in, first, with its requests per second, while the load runs
        # (read in the same look as its place). Its engine's tokens can bring it to the
        # top a pass before the gateway has answered its first request: 0.00 then.
        requests = page.wait_for_function(
            "name => { const first = document.querySelector('#fleet tr[data-deployment]');"
            " if (!first || first.dataset.deployment !== name) return false;"
            " const requests = first.querySelector('td.requests').textContent;"
            " return parseFloat(requests) > 0 && requests; }", arg=BUSY,
            timeout=60_000).json_value()
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert float(requests) > 0
    body = page.locator("#fleet tbody")
    assert int(body.get_attribute("data-messages")) > 1
    assert page.locator("#fleet tr[data-deployment]").count() == 50
    page.close()


def test_the_deployment_list_refreshes_its_page_and_suggests_names(browser: Any,
                                                                   served: Served) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    path = "/deployments/?search=fleet-idle&page=2"
    page.goto(f"{served.url}/login/?next=/deployments/%3Fsearch%3Dfleet-idle%26page%3D2")
    page.fill("input[name=username]", served.username)
    page.fill("input[name=password]", served.password)
    page.click("button[type=submit]")
    page.wait_for_url(served.url + path)
    rows = page.locator("#deployments tr[data-deployment]")
    assert rows.count() == IDLE - 50 and rows.first.get_attribute(
        "data-deployment") == "fleet-idle-50"
    # Two rounds of its own refresh (5 s each): still page 2 of the search, nothing more.
    page.wait_for_function("() => document.querySelector('#deployment-list').dataset"
                           ".refreshes?.startsWith('2 asked')", timeout=20_000)
    assert rows.count() == IDLE - 50
    assert page.locator('a[rel="prev"]').get_attribute("href") == "?search=fleet-idle"
    # The form's model: typed, with suggestions from the registry's search.
    model = page.locator("#deployment-form input[name=model]")
    model.fill("fa")
    page.wait_for_function("() => document.getElementById('model-names').dataset.matches"
                           " === '1'", timeout=10_000)
    assert page.locator("#model-names option").first.get_attribute("value") == "fake"
    page.close()


def test_the_playground_takes_a_typed_deployment_and_streams_its_answer(
        browser: Any, served: Served) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{served.url}/login/?next=/playground/")
    page.fill("input[name=username]", served.username)
    page.fill("input[name=password]", served.password)
    page.click("button[type=submit]")
    page.wait_for_url(served.url + "/playground/")
    page.wait_for_selector("#live-status.ready")
    # No list of every deployment: the first one to start from, the rest typed.
    assert page.locator("#deployment-a").input_value() == "fleet-idle-00"
    assert page.locator("select#deployment-a, #playground option").count() == 0
    page.fill("#deployment-a", "zz-fleet")
    page.wait_for_function("() => document.getElementById('deployment-names').dataset"
                           ".matches === '1'", timeout=10_000)
    page.fill("#deployment-a", BUSY)
    page.fill("#max_tokens", "8")
    page.fill("#prompt", "Hello")
    page.click("#send")
    page.wait_for_function(
        "() => document.querySelector('[data-column=\"a\"] .stats').dataset.done === '1'",
        timeout=30_000)
    assert page.locator('[data-column="a"] .column-title').inner_text() == BUSY
    assert page.locator('[data-column="a"] .turn.assistant').last.inner_text().strip()
    page.close()
