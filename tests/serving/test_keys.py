"""The key cache: a change is seen once it commits, never before, and no entry is
trusted past KEY_CACHE_SECONDS, so a key revoked where this process is not told (another
process, no Redis) is refused within that bound."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from django.db import transaction
from django.utils import timezone

from serving.models import ApiKey
from serving.services import create_api_key, revoke_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


def post(url: str, key: str) -> int:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}).status_code


def test_a_key_revoked_where_this_process_is_not_told_is_refused_once_its_entry_expires(
        gateway_url: str, fake_engines: Any, settings: Any) -> None:
    engine: FakeEngine = fake_engines("keys-1")
    publish("demo", [engine])
    settings.KEY_CACHE_SECONDS = 1.0
    record, key = create_api_key("elsewhere", "inference")
    assert post(gateway_url, key) == 200  # looked up and cached now
    cached_by = time.monotonic()
    # Another process revokes it: a plain UPDATE, no signal reaches this one.
    ApiKey.objects.filter(pk=record.pk).update(revoked_at=timezone.now())
    while time.monotonic() < cached_by + settings.KEY_CACHE_SECONDS:
        time.sleep(0.05)  # the bound under test is a time: wait it out
    assert post(gateway_url, key) == 401  # the first request after it, not a later one


def test_a_revocation_takes_effect_when_it_commits_not_before(
        gateway_url: str, fake_engines: Any) -> None:
    publish("demo", [fake_engines("keys-1")])
    record, key = create_api_key("racing", "inference")
    with transaction.atomic():
        revoke_api_key(record)
        # A request between the change and its commit reads the row as committed: the
        # key still works, and what it read must not outlive the commit.
        assert post(gateway_url, key) == 200
    assert post(gateway_url, key) == 401
