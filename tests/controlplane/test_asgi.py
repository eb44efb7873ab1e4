"""Every HTTP route outside /v1/ refuses a body over HTTP_MAX_BODY_BYTES with 413 before
Django reads it: anonymous callers cannot make the server hold large bodies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


@pytest.mark.parametrize("path", ["/api/v1/models/", "/login/", "/no-such-page/"])
def test_a_declared_body_over_the_limit_gets_413_without_being_read(
        gateway_url: str, settings: Any, path: str) -> None:
    settings.HTTP_MAX_BODY_BYTES = 64 * 1024
    answer = httpx.post(f"{gateway_url}{path}", content=b"x" * (2 * 1024 * 1024),
                        headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == 413
    assert answer.json()["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_gets_413(gateway_url: str, settings: Any) -> None:
    settings.HTTP_MAX_BODY_BYTES = 64 * 1024
    answer = httpx.post(f"{gateway_url}/api/v1/models/", content=chunks(1024 * 1024),
                        headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == 413


def test_a_body_within_the_limit_reaches_the_application(gateway_url: str,
                                                         settings: Any) -> None:
    settings.HTTP_MAX_BODY_BYTES = 64 * 1024
    answer = httpx.post(f"{gateway_url}/api/v1/models/", content=chunks(1024),
                        headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code in (401, 403)  # Django answered: no credentials
