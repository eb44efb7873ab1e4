"""Usage records: nothing lost to a long request id or one bad row (the database pass of
`make test` runs these on PostgreSQL, which enforces column widths and ranges)."""

from __future__ import annotations

import logging
import time
from typing import Any

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


def test_a_batch_written_again_adds_each_record_and_its_tokens_once() -> None:
    # As after a commit whose reply was lost: the writer cannot know the rows landed.
    make_api_key(ApiKey.Scope.INFERENCE)
    key = ApiKey.objects.get()
    batch = [usage("same-id", key.pk, 10), usage("same-id", key.pk, 20)]
    assert write_batch(batch) == 2  # two requests sharing a client's X-Request-Id
    assert write_batch(batch) == 0
    assert write_batch([*batch, usage("new", key.pk, 5)]) == 1
    assert UsageRecord.objects.count() == 3
    key.refresh_from_db()
    assert (key.requests_total, key.prompt_tokens_total) == (3, 35)


def test_a_refused_batch_written_again_row_by_row_skips_the_rows_already_there() -> None:
    make_api_key(ApiKey.Scope.INFERENCE)
    key = ApiKey.objects.get()
    landed = usage("landed", key.pk, 10)
    assert write_batch([landed]) == 1
    assert write_batch([landed, usage("refused", key.pk, -1), usage("new", key.pk, 7)]) == 1
    key.refresh_from_db()
    assert (key.requests_total, key.prompt_tokens_total) == (2, 17)


def test_records_wait_in_a_bounded_buffer_while_the_database_is_out_of_reach(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from prometheus_client import generate_latest

    from serving import usage as usage_module

    def unreachable(batch: list[Usage]) -> int:
        raise usage_module.StoreUnavailable("connection refused")

    monkeypatch.setattr(usage_module, "BUFFER_LIMIT", 3)
    dropped_before = metrics.USAGE_DROPPED._value.get()

    def buffered() -> float:  # as /metrics shows it
        line = next(line for line in generate_latest().decode().splitlines()
                    if line.startswith("fleetplane_gateway_usage_records_buffered "))
        return float(line.split()[1])

    async def five_records_then_flush() -> list[str]:
        elsewhere = buffered()  # other gateways' writers in this test process
        writer = usage_module.UsageWriter()
        for n in range(5):
            writer.buffer.append(usage(f"r{n}", 1, n))
        monkeypatch.setattr(usage_module, "write_batch", unreachable)
        assert await writer.flush() == 0
        assert buffered() == elsewhere + 3
        monkeypatch.undo()
        assert await writer.flush() == 3
        assert buffered() == elsewhere
        return [u.request_id for u in writer.buffer]

    assert asyncio.run(five_records_then_flush()) == []
    # The oldest two went; the newest three were written once the database answered.
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        "r2", "r3", "r4"]
    assert metrics.USAGE_DROPPED._value.get() == dropped_before + 2


def test_a_large_batch_written_again_adds_only_its_new_records() -> None:
    # Larger than one INSERT statement's rows: the records after an outage come in one.
    make_api_key(ApiKey.Scope.INFERENCE)
    key = ApiKey.objects.get()
    landed = [usage(f"r{n}", key.pk, 1) for n in range(1200)]
    assert write_batch(landed) == 1200
    assert write_batch([*landed, *(usage(f"new{n}", key.pk, 2) for n in range(5))]) == 5
    assert UsageRecord.objects.count() == 1205
    key.refresh_from_db()
    assert (key.requests_total, key.prompt_tokens_total) == (1205, 1210)


def test_the_writer_sleeps_with_nothing_buffered_and_wakes_for_the_next_record(
        settings: Any) -> None:
    import asyncio

    from serving import usage as usage_module

    settings.USAGE_FLUSH_SECONDS = 0.05
    make_api_key(ApiKey.Scope.INFERENCE)
    key_id = ApiKey.objects.get().pk

    async def two_records_apart() -> tuple[bool, bool]:
        writer = usage_module.UsageWriter()
        writer.add(usage("first", key_id, 1))
        first_task = writer.task
        assert first_task is not None
        await asyncio.wait_for(first_task, 10)  # written, then nothing left: it ended
        ended = first_task.done() and not writer.buffer
        writer.add(usage("second", key_id, 2))
        assert writer.task is not first_task  # a new one for the new record
        await asyncio.wait_for(writer.task, 10)  # type: ignore[arg-type]
        return ended, not writer.buffer

    assert asyncio.run(two_records_apart()) == (True, True)
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        "first", "second"]
