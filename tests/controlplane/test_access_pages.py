"""The keys and users pages as an admin meets them, in headless Chromium against
`manage.py serve`: a key made in the form is shown once, works at the gateway, and stops
working once revoked; a new user gets a role, a one-time password, and only the pages of
that role."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.processes import (
    end_replicas,
    free_port,
    login_from,
    manage,
    server_env,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    env = server_env(tmp_path_factory.mktemp("access") / "data")
    manage(env, "migrate", "--noinput", "-v0")
    port = free_port()
    process, output = start_server(env, port)
    username, password = login_from(output)
    try:
        yield f"http://127.0.0.1:{port}", username, password
    finally:
        stop_server(process)
        end_replicas(env["DATA_DIR"])


def log_in(browser: Any, url: str, username: str, password: str, path: str) -> Any:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{url}/login/?next={path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(url + path)
    return page


def test_a_key_made_in_the_page_is_shown_once_works_and_can_be_revoked(
        browser: Any, served: tuple[str, str, str]) -> None:
    url, username, password = served
    page = log_in(browser, url, username, password, "/keys/")
    page.fill("#team-form input[name=name]", "search")
    page.fill("#team-form input[name=rpm]", "100")
    page.click("#team-form button[type=submit]")
    page.locator("#teams td", has_text="search").wait_for()
    page.fill("#key-form input[name=name]", "crawler")
    page.fill("#key-form input[name=team]", "search")
    page.select_option("#key-form select[name=priority]", "batch")
    page.fill("#key-form input[name=rpm]", "2")
    page.click("#key-form button[type=submit]")
    secret = page.locator("#new-secret pre").inner_text().strip()
    row = page.locator('#keys tr[data-key="crawler"]')
    assert "team search" in row.inner_text() and "batch" in row.inner_text()
    assert secret.startswith(row.locator("code").inner_text().rstrip("…"))
    headers = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
    page.reload()
    assert page.locator("#new-secret").count() == 0  # shown once only
    row.locator("button:text('Revoke')").click()
    page.locator('#keys tr[data-key="crawler"] .state', has_text="revoked").wait_for()
    assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
    page.close()


def test_a_new_user_gets_a_role_and_only_its_pages(browser: Any,
                                                   served: tuple[str, str, str]) -> None:
    url, username, password = served
    page = log_in(browser, url, username, password, "/users/")
    page.fill("#user-form input[name=username]", "vera")
    page.select_option("#user-form select[name=role]", "viewer")
    page.click("#user-form button[type=submit]")
    new_password = page.locator("#new-password pre").inner_text().strip()
    assert page.locator('#users tr[data-user="vera"] .role').inner_text() == "viewer"
    page.close()
    viewer = log_in(browser, url, "vera", new_password, "/dashboard/")
    nav = viewer.locator("header nav").inner_text()
    assert "Dashboard" in nav and "Playground" not in nav and "Keys" not in nav
    assert viewer.goto(f"{url}/playground/").status == 403
    assert viewer.goto(f"{url}/keys/").status == 403
    viewer.close()
