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


def test_metrics_take_the_bearer_scheme_in_any_case(gateway_url: str, settings: Any) -> None:
    settings.METRICS_TOKEN = "scrape-me-0123456789"
    for scheme in ("bearer", "BEARER", "Bearer"):
        scraped = httpx.get(f"{gateway_url}/metrics", timeout=10,
                            headers={"Authorization": f"{scheme} scrape-me-0123456789"})
        assert (scheme, scraped.status_code) == (scheme, 200)
    for given in ("Basic scrape-me-0123456789", "bearer SCRAPE-ME-0123456789",
                  "scrape-me-0123456789"):
        refused = httpx.get(f"{gateway_url}/metrics", timeout=10,
                            headers={"Authorization": given})
        assert (given, refused.status_code) == (given, 401)
