"""Usage records, written in batches off the hot path.

The gateway appends a record to an in-memory buffer; a background task writes the buffer
with one bulk insert every USAGE_FLUSH_SECONDS (or at once when it is large). A batch the
database refuses is written again row by row, so one bad row costs only itself: a row that
still fails is logged with its content and counted in
`fleetplane_gateway_usage_records_dropped_total`, and the keys' totals count exactly the
rows written.

While the database cannot be reached the records stay buffered (at most BUFFER_LIMIT per
event loop, the oldest dropped beyond it, each logged and counted as dropped), and the
writer tries again with a backoff of at most 30 s. `fleetplane_gateway_usage_records_buffered`
shows how many wait. Each record carries an id made here (`record_id`, unique in the
table), and rows are inserted with ON CONFLICT DO NOTHING: a batch written a second time
(a commit whose reply was lost, so the writer could not know it had landed) adds nothing,
and the keys' totals count only the rows that were inserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from serving import metrics
from serving.calls import new_id
from serving.wakeup import until_beat

logger = logging.getLogger(__name__)
FLUSH_AT = 1000
# Records kept while the database is out of reach; the oldest beyond are dropped.
BUFFER_LIMIT = 100_000
# Rows per INSERT statement when a batch is written again (16 parameters each: within
# the limits of SQLite and PostgreSQL).
ROWS_PER_STATEMENT = 500


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
    record_id: str = field(default_factory=new_id)


_writers: weakref.WeakSet[UsageWriter] = weakref.WeakSet()


def records_waiting() -> int:
    """Records not yet in the database, over every writer of this process (buffered, and
    in a batch being written): read when /metrics is scraped, so nothing is counted on
    the hot path."""
    return sum(len(w.buffer) + w.in_batch for w in list(_writers))


metrics.USAGE_BUFFERED.set_function(records_waiting)


class UsageWriter:
    def __init__(self) -> None:
        self.buffer: list[Usage] = []
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.unreachable = 0  # flushes in a row that found the database out of reach
        self.writing = 0  # batches being written now (in a worker thread)
        self.in_batch = 0  # records in those batches
        _writers.add(self)

    def add(self, usage: Usage) -> None:
        self.buffer.append(usage)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.run())
        if len(self.buffer) >= FLUSH_AT:
            self.wake.set()

    async def run(self) -> None:
        """Write the buffer every USAGE_FLUSH_SECONDS (at once when it holds FLUSH_AT)
        while records come; ends when a flush leaves nothing buffered, and `add` starts
        it again with the next record, so a gateway with no traffic has no writer waking
        up every second."""
        while True:
            if self.unreachable:
                # Back off while the database is away, however full the buffer is.
                await asyncio.sleep(min(30.0, settings.USAGE_FLUSH_SECONDS
                                        * 2 ** min(self.unreachable, 6)))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(until_beat(settings.USAGE_FLUSH_SECONDS)):
                    await self.wake.wait()
            self.wake.clear()
            await self.flush()
            if not self.buffer:  # `add` sees the task done, and starts another
                return

    async def flush(self) -> int:
        """Write what is buffered; returns how many records were written. Records the
        database could not be reached for stay buffered (up to BUFFER_LIMIT) for the next
        flush."""
        batch, self.buffer = self.buffer, []
        if not batch:
            return 0
        self.writing += 1
        self.in_batch += len(batch)
        try:
            written = await sync_to_async(write_batch, thread_sensitive=False)(batch)
            if self.unreachable:
                logger.warning("the database is back: wrote %d buffered usage records",
                               written)
            self.unreachable = 0
            return written
        except StoreUnavailable as exc:
            self.unreachable += 1
            if self.unreachable == 1:
                logger.warning("could not reach the database for %d usage records (%s); "
                               "keeping them (at most %d) and trying again with a backoff",
                               len(batch), exc, BUFFER_LIMIT)
            self.buffer = batch + self.buffer
            over = len(self.buffer) - BUFFER_LIMIT
            if over > 0:
                for usage in self.buffer[:over]:
                    _drop(usage, "the buffer is full while the database is out of reach")
                del self.buffer[:over]
        except Exception:
            logger.exception("could not write %d usage records", len(batch))
            for usage in batch:
                _drop(usage, "it could not be written")
        finally:
            self.writing -= 1
            self.in_batch -= len(batch)
        return 0


COLUMNS = ("at", "request_id", "key_id", "model", "deployment", "replica", "status", "stream",
           "prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms", "itl_ms", "e2e_ms",
           "username", "record_id")


class StoreUnavailable(Exception):
    """The database could not be reached: nothing of the batch was written."""


def write_batch(batch: list[Usage]) -> int:
    """Write the batch in one transaction; if the database refuses it, row by row (one
    savepoint each, in one transaction with the keys' totals). Returns how many rows were
    written. Raises StoreUnavailable, having written nothing, when the database is out of
    reach."""
    from django.db import (
        DatabaseError,
        InterfaceError,
        OperationalError,
        close_old_connections,
        connection,
        transaction,
    )

    from serving.sqlite_commits import eventless_transaction

    close_old_connections()
    # Looked up once: `connection` is a proxy reaching the thread's connection through
    # asgiref's Local (a few microseconds a lookup), and a batch holds a second's records.
    adapt = connection.ops.adapt_datetimefield_value
    rows = [_row(u, adapt) for u in batch]
    try:
        try:
            with eventless_transaction(), connection.cursor() as cursor:
                return _write_new(cursor, connection, batch, rows)
        except _WrittenBefore:  # rolled back: which rows are new is sorted out row by row
            with transaction.atomic(), connection.cursor() as cursor:
                return _write_the_rest(cursor, connection, batch, rows)
    except (OperationalError, InterfaceError) as exc:
        raise StoreUnavailable(str(exc)) from exc
    except (DatabaseError, ValueError, OverflowError):
        logger.warning("the database refused a batch of %d usage records; writing them "
                       "one by one", len(batch), exc_info=True)
    written: list[Usage] = []
    dropped: list[Usage] = []
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for usage, row in zip(batch, rows, strict=True):
                try:
                    with transaction.atomic():
                        if _insert(cursor, connection, [row]):
                            written.append(usage)  # else already written: not again
                except (OperationalError, InterfaceError):
                    raise
                except (DatabaseError, ValueError, OverflowError):
                    dropped.append(usage)
            _add_to_key_totals(cursor, written, connection)
    except (OperationalError, InterfaceError) as exc:
        raise StoreUnavailable(str(exc)) from exc
    for usage in dropped:
        _drop(usage)
    return len(written)


def _drop(usage: Usage, why: str = "the database refuses it") -> None:
    metrics.USAGE_DROPPED.inc()
    logger.error("dropped a usage record (%s): %r", why, usage)


class _WrittenBefore(Exception):
    """Some rows of the batch are in the table already (a batch written again)."""


def _write_new(cursor: Any, connection: Any, batch: list[Usage],
               rows: list[tuple[Any, ...]]) -> int:
    """The common case, in one statement: every row is new (else _WrittenBefore)."""
    from serving.models import UsageRecord

    q = connection.ops.quote_name
    cursor.executemany(
        f"INSERT INTO {q(UsageRecord._meta.db_table)} ({', '.join(q(c) for c in COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(COLUMNS))}) "
        f"ON CONFLICT ({q('record_id')}) DO NOTHING", rows)
    if cursor.rowcount != len(rows):
        raise _WrittenBefore
    _add_to_key_totals(cursor, batch, connection)
    return len(rows)


def _write_the_rest(cursor: Any, connection: Any, batch: list[Usage],
                    rows: list[tuple[Any, ...]]) -> int:
    """A batch written again: the rows not in the table yet, and their keys' totals."""
    inserted: set[str] = set()
    for start in range(0, len(rows), ROWS_PER_STATEMENT):
        inserted |= _insert(cursor, connection, rows[start:start + ROWS_PER_STATEMENT])
    _add_to_key_totals(cursor, [u for u in batch if u.record_id in inserted], connection)
    return len(inserted)


def _insert(cursor: Any, connection: Any, rows: list[tuple[Any, ...]]) -> set[str]:
    """Insert the rows whose record id is not in the table yet (SQLite and PostgreSQL
    both speak ON CONFLICT ... DO NOTHING and RETURNING); returns the ids inserted."""
    from serving.models import UsageRecord

    q = connection.ops.quote_name
    one = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"
    cursor.execute(
        f"INSERT INTO {q(UsageRecord._meta.db_table)} ({', '.join(q(c) for c in COLUMNS)}) "
        f"VALUES {', '.join([one] * len(rows))} "
        f"ON CONFLICT ({q('record_id')}) DO NOTHING RETURNING {q('record_id')}",
        [value for row in rows for value in row])
    return {record_id for (record_id,) in cursor.fetchall()}


def _row(u: Usage, adapt: Callable[[datetime], Any]) -> tuple[Any, ...]:
    """Plain values, not a model instance: this runs in a thread beside the relay, and
    every microsecond it holds the interpreter is one the relay waits. `adapt` is the
    connection's adapt_datetimefield_value."""
    return (adapt(datetime.fromtimestamp(u.at, UTC)), u.request_id, u.key_id, u.model,
            u.deployment, u.replica, u.status, u.stream, u.prompt_tokens,
            u.completion_tokens, u.queue_ms, u.ttft_ms, u.itl_ms, u.e2e_ms, u.username,
            u.record_id)


def _add_to_key_totals(cursor: Any, written: list[Usage], connection: Any) -> None:
    """The keys' totals: one UPDATE per key, for the rows written."""
    from serving.models import ApiKey

    totals: dict[int, list[Any]] = {}
    for u in written:
        if u.key_id is None:
            continue
        entry = totals.setdefault(u.key_id, [0, 0, 0, u.at])
        entry[0] += 1
        entry[1] += u.prompt_tokens or 0
        entry[2] += u.completion_tokens or 0
        entry[3] = max(entry[3], u.at)
    if not totals:
        return
    at = connection.ops.adapt_datetimefield_value
    keys = connection.ops.quote_name(ApiKey._meta.db_table)
    q = connection.ops.quote_name
    cursor.executemany(
        f"UPDATE {keys} SET {q('requests_total')} = {q('requests_total')} + %s, "
        f"{q('prompt_tokens_total')} = {q('prompt_tokens_total')} + %s, "
        f"{q('completion_tokens_total')} = {q('completion_tokens_total')} + %s, "
        f"{q('last_used_at')} = %s WHERE {q('id')} = %s",
        # In key order, so concurrent writers lock rows in the same order.
        [(n, p, c, at(datetime.fromtimestamp(last, UTC)), key_id)
         for key_id, (n, p, c, last) in sorted(totals.items())])
