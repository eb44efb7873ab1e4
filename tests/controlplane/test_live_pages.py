"""The playground and the dashboards as a user meets them: `manage.py serve` with the demo
deployment (a real vLLM CPU replica of the demo model), pages driven in headless Chromium,
answers streamed over the WebSocket, charts fed by the collector. Screenshots are kept in
test-artifacts/ (or TEST_ARTIFACTS_DIR)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI

from tests.pages import keep_screenshot
from tests.processes import (
    ROOT,
    Api,
    end_replicas,
    free_port,
    login_from,
    manage,
    server_env,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]

DEPLOYMENT = "smollm2"


@dataclass
class Live:
    url: str
    username: str
    password: str
    key: str


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("TEST_ARTIFACTS_DIR") or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    env = server_env(tmp_path_factory.mktemp("live") / "data", SCRAPE_INTERVAL="1")
    manage(env, "migrate", "--noinput", "-v0")
    manage(env, "import_demo_model")
    manage(env, "ensure_demo_deployment")
    key = manage(env, "create_api_key", "--name", "load", "--scope",
                 "inference").stdout.strip().splitlines()[-1]
    port = free_port()
    process, output = start_server(env, port)
    username, password = login_from(output)
    url = f"http://127.0.0.1:{port}"
    try:
        Api(url, key).wait_for(
            "the demo replica to serve",
            lambda: any(m["id"] == DEPLOYMENT and m["ready_replicas"]
                        for m in Api(url, key).get("/v1/models")["data"]), 600, 2)
        yield Live(url, username, password, key)
    finally:
        stop_server(process)
        end_replicas(env["DATA_DIR"])


def logged_in_page(browser: object, live: Live, path: str) -> object:
    page = browser.new_page(viewport={"width": 1280, "height": 900})  # type: ignore
    page.goto(live.url + "/login/?next=" + path)
    page.fill("input[name=username]", live.username)
    page.fill("input[name=password]", live.password)
    page.click("button[type=submit]")
    page.wait_for_url(live.url + path)
    page.wait_for_selector("#live-status.ready")  # the socket is open
    return page


def test_the_playground_streams_the_demo_models_answer(browser: object, live: Live,
                                                       artifacts: Path) -> None:
    page: object = logged_in_page(browser, live, "/playground/")
    assert page.locator("#deployment-a").input_value() == DEPLOYMENT  # type: ignore
    page.fill("#system", "You are a helpful assistant.")  # type: ignore
    page.fill("#temperature", "0")  # type: ignore
    page.fill("#max_tokens", "48")  # type: ignore
    page.fill("#prompt", "Name three colours of the rainbow.")  # type: ignore
    page.click("#send")  # type: ignore
    answer = page.locator('[data-column="a"] .turn.assistant').last  # type: ignore
    stats = page.locator('[data-column="a"] .stats')  # type: ignore
    lengths: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lengths.append(len(answer.inner_text()))
        if stats.get_attribute("data-done"):
            break
        time.sleep(0.02)
    assert stats.get_attribute("data-done") == "1", stats.inner_text()
    growth = sorted({n for n in lengths if n})
    assert len(growth) >= 3, f"the answer arrived in {len(growth)} step(s): {growth}"
    final = answer.inner_text()
    assert final.strip(), "no text arrived"
    text = stats.inner_text()
    assert "TTFT" in text and "tokens/s" in text and "completion tokens" in text
    assert float(stats.get_attribute("data-browser-ttft-ms")) > 0
    keep_screenshot(page, artifacts / "playground.png")

    # A second turn continues the same conversation.
    page.fill("#prompt", "And one more?")  # type: ignore
    page.click("#send")  # type: ignore
    page.wait_for_function(  # type: ignore
        "() => document.querySelector('[data-column=\"a\"] .stats').dataset.done === '1'",
        timeout=120_000)
    assert page.locator('[data-column="a"] .turn.user').count() == 2  # type: ignore
    page.close()  # type: ignore


def test_stop_ends_a_long_answer(browser: object, live: Live) -> None:
    page: object = logged_in_page(browser, live, "/playground/")
    page.fill("#max_tokens", "1000")  # type: ignore
    page.fill("#prompt", "Write a long story about a lighthouse keeper.")  # type: ignore
    page.click("#send")  # type: ignore
    page.wait_for_function(  # type: ignore
        "() => document.querySelector('[data-column=\"a\"] .stats').dataset.browserTtftMs",
        timeout=120_000)
    page.click("#stop")  # type: ignore
    page.wait_for_function(  # type: ignore
        "() => document.querySelector('[data-column=\"a\"] .stats').dataset.done === 'stopped'",
        timeout=30_000)
    assert not page.locator("#send").is_disabled()  # type: ignore
    page.close()  # type: ignore


def test_the_playground_says_what_is_wrong_with_a_request(browser: object,
                                                          live: Live) -> None:
    page: object = logged_in_page(browser, live, "/playground/")
    page.fill("#max_tokens", "999999")  # type: ignore
    page.fill("#prompt", "Hello")  # type: ignore
    page.click("#send")  # type: ignore
    error = page.locator("#playground-error")  # type: ignore
    error.wait_for()
    page.wait_for_function(  # type: ignore
        "() => document.getElementById('playground-error').textContent.length > 0")
    assert "`max_tokens` must be a number from 1 to" in error.inner_text()
    page.close()  # type: ignore


def load(live: Live, stop: threading.Event) -> None:
    client = OpenAI(base_url=live.url + "/v1", api_key=live.key)
    while not stop.is_set():
        client.chat.completions.create(model=DEPLOYMENT, max_tokens=32, messages=[
            {"role": "user", "content": "Say something about the sea."}])


def test_the_dashboards_move_under_load(browser: object, live: Live,
                                        artifacts: Path) -> None:
    page: object = logged_in_page(browser, live, f"/dashboard/{DEPLOYMENT}/")
    chart = page.locator("#chart-tps")  # type: ignore
    chart.wait_for()
    before = int(chart.get_attribute("data-points") or 0)
    stop = threading.Event()
    workers = [threading.Thread(target=load, args=(live, stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        page.wait_for_function(  # type: ignore
            "() => { const e = document.querySelector('#chart-tps');"
            " return e && Number(e.dataset.last) > 0; }", timeout=60_000)
        page.wait_for_function(  # type: ignore
            "() => parseFloat(document.querySelector('[data-field=\"tokens_per_s\"]')"
            ".textContent) > 0", timeout=30_000)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    after = int(chart.get_attribute("data-points") or 0)
    assert after > before
    assert page.locator("#chart-queue canvas").count() == 1  # type: ignore
    assert page.locator("#chart-accel").get_attribute("data-series") != "0"  # type: ignore
    keep_screenshot(page, artifacts / "dashboard.png")

    page.goto(live.url + "/dashboard/")  # type: ignore
    row = page.locator(f'#fleet tr[data-deployment="{DEPLOYMENT}"]')  # type: ignore
    row.wait_for(timeout=10_000)
    assert row.locator("td").nth(1).inner_text().startswith("1 / 1")
    keep_screenshot(page, artifacts / "fleet.png")
    page.close()  # type: ignore
