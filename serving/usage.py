"""Usage records, written in batches off the hot path.

The gateway appends a record to an in-memory buffer; a background task writes the buffer
with one bulk insert every USAGE_FLUSH_SECONDS (or at once when it is large).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

logger = logging.getLogger(__name__)
FLUSH_AT = 1000


@dataclass
class Usage:
    at: float  # seconds since the epoch (time.time()), a datetime once written
    request_id: str
    key_id: int | None
    model: str
    deployment: str
    replica: str
    status: int
    stream: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    queue_ms: float
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float
    username: str = ""


class UsageWriter:
    def __init__(self) -> None:
        self.buffer: list[Usage] = []
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()

    def add(self, usage: Usage) -> None:
        self.buffer.append(usage)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.run())
        if len(self.buffer) >= FLUSH_AT:
            self.wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=settings.USAGE_FLUSH_SECONDS)
            except TimeoutError:
                pass
            self.wake.clear()
            await self.flush()

    async def flush(self) -> int:
        batch, self.buffer = self.buffer, []
        if not batch:
            return 0
        try:
            await sync_to_async(write_batch, thread_sensitive=False)(batch)
        except Exception:
            logger.exception("could not write %d usage records", len(batch))
            return 0
        return len(batch)


COLUMNS = ("at", "request_id", "key_id", "model", "deployment", "replica", "status", "stream",
           "prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms", "itl_ms", "e2e_ms",
           "username")


def write_batch(batch: list[Usage]) -> None:
    """One INSERT for the whole batch. Plain rows, not model instances: this runs in a
    thread beside the relay, and every microsecond it holds the interpreter is one the
    relay waits."""
    from django.db import close_old_connections, connection, transaction

    from serving.models import ApiKey, UsageRecord

    close_old_connections()
    table = connection.ops.quote_name(UsageRecord._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(c) for c in COLUMNS)
    placeholders = ", ".join(["%s"] * len(COLUMNS))
    at = connection.ops.adapt_datetimefield_value
    rows = [(at(datetime.fromtimestamp(u.at, UTC)), u.request_id, u.key_id, u.model,
             u.deployment, u.replica, u.status,
             u.stream, u.prompt_tokens, u.completion_tokens, u.queue_ms, u.ttft_ms, u.itl_ms,
             u.e2e_ms, u.username) for u in batch]
    # The keys' totals: one UPDATE per key in the batch.
    totals: dict[int, list[Any]] = {}
    for u in batch:
        if u.key_id is None:
            continue
        entry = totals.setdefault(u.key_id, [0, 0, 0, u.at])
        entry[0] += 1
        entry[1] += u.prompt_tokens or 0
        entry[2] += u.completion_tokens or 0
        entry[3] = max(entry[3], u.at)
    keys = connection.ops.quote_name(ApiKey._meta.db_table)
    q = connection.ops.quote_name
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(f"INSERT INTO {table} ({columns}) VALUES ({placeholders})", rows)
        if totals:
            cursor.executemany(
                f"UPDATE {keys} SET {q('requests_total')} = {q('requests_total')} + %s, "
                f"{q('prompt_tokens_total')} = {q('prompt_tokens_total')} + %s, "
                f"{q('completion_tokens_total')} = {q('completion_tokens_total')} + %s, "
                f"{q('last_used_at')} = %s WHERE {q('id')} = %s",
                # In key order, so concurrent writers lock rows in the same order.
                [(n, p, c, at(datetime.fromtimestamp(last, UTC)), key_id)
                 for key_id, (n, p, c, last) in sorted(totals.items())])
