"""Debug pages (DEBUG on, the development run) show no secrets: settings that look secret,
URLs with credentials in them (DATABASE_URL, REDIS_URL, the channel layer's hosts) and
such values in the failing code's variables are hidden."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path

# Made at run time: the traceback shows the source around each frame, and a secret
# written in this file would be found there.
SECRET = "".join(["hun", "ter", "2"])
REDIS_URL = f"redis://:redis-{SECRET}@redis.example:6379/0"
ENDPOINT = f"https://fleet-user:endpoint-{SECRET}@llm.example/v1"


def failing_view(request: HttpRequest) -> HttpResponse:
    endpoint = ENDPOINT  # a local variable shown in the traceback's frames
    metrics_token = f"token-{SECRET}"
    raise RuntimeError(f"could not reach the endpoint ({len(endpoint + metrics_token)})")


urlpatterns = [path("fail/", failing_view)]


@pytest.fixture
def secret_settings(settings: Any) -> None:
    settings.REDIS_URL = REDIS_URL
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [REDIS_URL]}}}
    settings.METRICS_TOKEN = f"metrics-{SECRET}"
    settings.SECRET_KEY = f"secret-key-{SECRET}" + "x" * 50
    settings.DATABASE_URL = f"postgres://fleet:db-{SECRET}@db.example/fleet"


@pytest.mark.urls(__name__)
def test_a_debug_500_page_hides_credentials_and_secrets(settings: Any,
                                                         secret_settings: None) -> None:
    settings.DEBUG = True
    page = Client(raise_request_exception=False).get(
        "/fail/", HTTP_AUTHORIZATION=f"Bearer fp-key-{SECRET}",
        HTTP_X_UPSTREAM=f"postgres://app:header-{SECRET}@db.example/fleet")
    assert page.status_code == 500
    text = page.content.decode()
    assert "RuntimeError" in text and "REDIS_URL" in text  # the debug page it is
    assert "redis://********@redis.example:6379/0" in text
    assert "https://********@llm.example/v1" in text
    assert "postgres://********@db.example/fleet" in text
    assert SECRET not in text


@pytest.mark.urls(__name__)
def test_with_debug_off_a_500_is_a_plain_page(settings: Any, secret_settings: None) -> None:
    settings.DEBUG = False
    page = Client(raise_request_exception=False).get("/fail/")
    assert page.status_code == 500
    assert "RuntimeError" not in page.content.decode()
    assert "REDIS_URL" not in page.content.decode()
