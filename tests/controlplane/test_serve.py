"""The product as a user meets it: `manage.py serve` on a real port, the demo model
imported by `import_demo_model`, pages driven in headless Chromium, the REST API over HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.pages import keep_screenshot
from tests.processes import (
    free_port,
    login_from,
    manage,
    server_env,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@dataclass
class Served:
    url: str
    env: dict[str, str]
    username: str
    password: str
    first_output: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    env = server_env(tmp_path_factory.mktemp("product") / "data")
    manage(env, "migrate", "--noinput", "-v0")
    imported = manage(env, "import_demo_model")
    assert "is ready" in imported.stdout
    port = free_port()
    process, output = start_server(env, port)
    username, password = login_from(output)
    try:
        yield Served(f"http://127.0.0.1:{port}", env, username, password, output)
    finally:
        stop_server(process)


def log_in(page: object, served: Served) -> None:
    page.goto(served.url + "/")  # type: ignore[attr-defined]
    page.fill("input[name=username]", served.username)  # type: ignore[attr-defined]
    page.fill("input[name=password]", served.password)  # type: ignore[attr-defined]
    page.click("button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_url(served.url + "/models/")  # type: ignore[attr-defined]


def test_start_up_prints_the_url_and_the_generated_password_once(served: Served) -> None:
    assert f"starting on {served.url}/" in served.first_output
    assert "shown only now and stored hashed" in served.first_output
    stored = manage(served.env, "shell", "-c",
                    "from django.contrib.auth.models import User; "
                    "print(User.objects.get(username='admin').password)").stdout
    assert stored.strip().splitlines()[-1].startswith("pbkdf2_sha256$")
    assert served.password not in stored


def test_the_front_page_asks_for_a_login(served: Served, browser: object) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(served.url + "/")
    assert "/login/" in page.url
    assert page.locator("h1").inner_text() == "Log in"
    page.close()


def test_a_wrong_password_is_refused(served: Served, browser: object) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(served.url + "/login/")
    page.fill("input[name=username]", served.username)
    page.fill("input[name=password]", "not-the-password")
    page.click("button[type=submit]")
    assert "did not match" in page.locator(".error").inner_text()
    page.close()


def test_after_login_the_registry_lists_the_demo_model_ready_with_capacity(
    served: Served, browser: object, tmp_path: Path
) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    log_in(page, served)
    row = page.locator('tr[data-model="smollm2-135m-instruct"]')
    assert row.locator(".badge").inner_text() == "Ready"
    assert "LlamaForCausalLM" in row.inner_text()
    assert "134.5M" in row.inner_text()
    capacity = row.locator("td.capacity")
    assert capacity.count() == 3
    assert "seqs" in capacity.first.inner_text()
    keep_screenshot(page, tmp_path / "registry.png")

    row.locator("a").first.click()
    page.wait_for_url(served.url + "/models/smollm2-135m-instruct/")
    assert page.locator("#kv-per-token").inner_text() == "23,040 bytes"
    page.fill("input[name=memory_gib]", "16")
    page.click("button:text('Estimate')")
    rows = page.locator("#capacity tbody tr")
    assert rows.count() == 1
    assert rows.first.locator("td").first.inner_text() == "16 GiB"
    page.close()


def test_the_api_documentation_page_works_offline(served: Served, browser: object) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    failed: list[str] = []
    page.on("requestfailed", lambda request: failed.append(request.url))
    log_in(page, served)
    page.goto(served.url + "/api/docs/")
    page.wait_for_selector(".swagger-ui .info .title", timeout=15_000)
    assert "Fleetplane API" in page.locator(".swagger-ui .info .title").inner_text()
    assert failed == []
    page.close()


def test_the_api_lists_the_demo_model_to_an_admin_key(served: Served) -> None:
    key = manage(served.env, "create_api_key", "--name", "e2e", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    response = httpx.get(served.url + "/api/v1/models/",
                         headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    model = response.json()["results"][0]
    assert model["name"] == "smollm2-135m-instruct"
    assert model["status"] == "ready"
    assert model["architecture"] == "LlamaForCausalLM"
    assert 130_000_000 < model["parameter_count"] < 140_000_000
    assert model["context_length"] == 8192
    assert model["kv_bytes_per_token"] == 23_040


def test_a_second_start_reuses_everything_and_prints_no_password(served: Served) -> None:
    started = time.monotonic()
    again = manage(served.env, "import_demo_model")
    assert "is ready" in again.stdout
    process, output = start_server(served.env, free_port())
    try:
        assert time.monotonic() - started < 30
        assert "password was printed at first start" in output
        assert served.password not in output
    finally:
        stop_server(process)
