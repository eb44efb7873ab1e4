"""The client's address: from X-Forwarded-For only through a trusted proxy, so the
failed-attempt limit holds one client, not everyone behind the same ingress, and cannot be
dodged by writing the header."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from serving.proxies import client_address

pytestmark = pytest.mark.django_db(transaction=True)


def scope(peer: str, forwarded: str | None = None) -> dict[str, Any]:
    headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded else []
    return {"type": "http", "client": (peer, 5000), "headers": headers}


def guess(url: str, forwarded: str) -> int:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "fake", "prompt": "hi"},
                      headers={"Authorization": "Bearer fp-guess",
                               "X-Forwarded-For": forwarded}).status_code


def test_without_trusted_proxies_the_connection_is_the_client(settings: Any) -> None:
    settings.TRUSTED_PROXIES = []
    assert client_address(scope("203.0.113.9", "198.51.100.1")) == "203.0.113.9"


def test_behind_a_trusted_proxy_the_nearest_untrusted_hop_is_the_client(
        settings: Any) -> None:
    settings.TRUSTED_PROXIES = ["10.0.0.0/8"]
    # The client wrote a forged first entry; the ingress appended the real one.
    assert client_address(scope("10.1.2.3", "1.2.3.4, 198.51.100.7")) == "198.51.100.7"
    assert client_address(scope("10.1.2.3", "198.51.100.7, 10.9.9.9")) == "198.51.100.7"
    assert client_address(scope("10.1.2.3", "not-an-address")) == "10.1.2.3"
    assert client_address(scope("203.0.113.9", "198.51.100.7")) == "203.0.113.9"
    # A dual-stack listener sees an IPv4 proxy as ::ffff:a.b.c.d: still that proxy.
    assert client_address(scope("::ffff:10.1.2.3", "198.51.100.7")) == "198.51.100.7"


def test_a_forged_forwarded_header_does_not_escape_the_failed_attempt_limit(
        gateway_url: str, settings: Any) -> None:
    settings.TRUSTED_PROXIES = []
    settings.GATEWAY_AUTH_FAILURES_PER_MINUTE = 2
    codes = [guess(gateway_url, f"198.51.100.{n}") for n in range(4)]
    assert codes == [401, 401, 429, 429]


def test_clients_behind_a_trusted_proxy_are_counted_apart(
        gateway_url: str, settings: Any) -> None:
    settings.TRUSTED_PROXIES = ["127.0.0.1"]
    settings.GATEWAY_AUTH_FAILURES_PER_MINUTE = 2
    assert [guess(gateway_url, "198.51.100.20") for _ in range(3)] == [401, 401, 429]
    assert guess(gateway_url, "198.51.100.21") == 401  # another client: its own count
