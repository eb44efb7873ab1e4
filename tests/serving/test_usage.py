"""Usage records: nothing lost to a long request id or one bad row (the database pass of
`make test` runs these on PostgreSQL, which enforces column widths and ranges)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from serving import metrics
from serving.models import REQUEST_ID_MAX_LENGTH, ApiKey, UsageRecord
from serving.usage import Usage, write_batch
from tests.factories import make_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)


def usage(request_id: str, key_id: int, prompt_tokens: int) -> Usage:
    return Usage(at=time.time(), request_id=request_id, key_id=key_id, model="fake",
                 deployment="demo", replica="demo-1", status=200, stream=False,
                 prompt_tokens=prompt_tokens, completion_tokens=4, queue_ms=0.0,
                 ttft_ms=1.0, itl_ms=None, e2e_ms=2.0)


def test_the_longest_request_id_the_gateway_accepts_is_recorded_in_full(
        gateway_url: str, fake_engines: object) -> None:
    key = make_api_key(ApiKey.Scope.INFERENCE)
    engine: FakeEngine = fake_engines("demo-1")  # type: ignore[operator]
    publish("demo", [engine])
    request_id = "r" * REQUEST_ID_MAX_LENGTH
    answer = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                        headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id},
                        json={"model": "fake", "prompt": "hi", "max_tokens": 4})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == request_id
    records = UsageRecord.objects.filter(request_id=request_id)
    deadline = time.monotonic() + 10
    while not records.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert records.get().completion_tokens == 4
    assert ApiKey.objects.get().requests_total == 1


def test_a_row_the_database_refuses_costs_only_itself(
        caplog: pytest.LogCaptureFixture) -> None:
    make_api_key(ApiKey.Scope.INFERENCE)
    key = ApiKey.objects.get()
    dropped_before = metrics.USAGE_DROPPED._value.get()
    batch = [usage("first", key.pk, 10), usage("refused", key.pk, -1),
             usage("third", key.pk, 30)]
    with caplog.at_level(logging.ERROR, logger="serving.usage"):
        assert write_batch(batch) == 2
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        "first", "third"]
    key.refresh_from_db()
    assert (key.requests_total, key.prompt_tokens_total, key.completion_tokens_total) == (
        2, 40, 8)
    assert metrics.USAGE_DROPPED._value.get() == dropped_before + 1
    assert "request_id='refused'" in caplog.text
