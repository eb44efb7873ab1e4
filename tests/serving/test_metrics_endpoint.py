"""/metrics with and without METRICS_TOKEN, over HTTP to the ASGI application in this
process."""

from __future__ import annotations

from typing import Any

import httpx


def test_metrics_need_the_bearer_token_when_one_is_set(gateway_url: str,
                                                       settings: Any) -> None:
    settings.METRICS_TOKEN = "scrape-me-0123456789"
    anonymous = httpx.get(f"{gateway_url}/metrics", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert "fleetplane_" not in anonymous.text
    wrong = httpx.get(f"{gateway_url}/metrics", timeout=10,
                      headers={"Authorization": "Bearer scrape-me-0123456788"})
    assert wrong.status_code == 401
    scraped = httpx.get(f"{gateway_url}/metrics", timeout=10,
                        headers={"Authorization": "Bearer scrape-me-0123456789"})
    assert scraped.status_code == 200
    assert "fleetplane_gateway_requests_total" in scraped.text


def test_metrics_are_open_without_a_token(gateway_url: str, settings: Any) -> None:
    settings.METRICS_TOKEN = ""
    assert httpx.get(f"{gateway_url}/metrics", timeout=10).status_code == 200
