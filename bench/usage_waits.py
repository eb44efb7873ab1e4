"""How long the gateway held each request before writing it to the replica, from its own
usage records: `queue_ms`, from the request's arrival with its key known to the upstream
write (serving/gateway/accounting.py), read from the server's SQLite database, for the
benchmarks that split a first token's time between the gateway and the engine."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path


def now_as_stored() -> str:
    """The time now (UTC) as Django stores a record's `at` in SQLite, to compare with."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def waits_since(database: Path, since: str) -> list[float]:
    """`queue_ms` of the usage records the server wrote after `since`; none where the
    server keeps no SQLite database there (one on PostgreSQL, say)."""
    if not database.is_file():
        return []
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
    try:
        rows = connection.execute("SELECT queue_ms FROM serving_usagerecord WHERE at > ?",
                                  (since,)).fetchall()
    finally:
        connection.close()
    return [float(row[0]) for row in rows]


def wait_for_records(database: Path, since: str, count: int,
                     seconds: float = 30.0) -> list[float]:
    """The records written after `since`, once the server's usage writer has `count` of
    them (or after `seconds`, with what there is); none at once where there is no such
    database."""
    deadline = time.monotonic() + seconds
    while database.is_file():
        waits = waits_since(database, since)
        if len(waits) >= count or time.monotonic() > deadline:
            return waits
        time.sleep(0.2)
    return []


def after_records(databases: Iterable[Path | None], since: str, count: int) -> str:
    """The time now as stored, once each database (None: none) holds `count` records
    written after `since` (a warm-up's): a record dated after it is one of what came next,
    not a warm-up request the server recorded after the client had its last byte."""
    for database in databases:
        if database is not None:
            wait_for_records(database, since, count)
    return now_as_stored()


def integrity(database: Path) -> str:
    """SQLite's own check of the database (`PRAGMA quick_check`): "ok", or what it found
    wrong, or why the file could not be read."""
    try:
        connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
        try:
            rows = connection.execute("PRAGMA quick_check").fetchall()
        finally:
            connection.close()
    except sqlite3.Error as error:
        return f"unreadable: {error}"
    return "; ".join(str(row[0]) for row in rows)


def held_in(database: Path | None, since: str, count: int) -> list[float]:
    """Seconds each request the gateway recorded after `since` (waiting for `count` of
    them) spent in it, from its arrival with its key known to its upstream write; none
    without a database."""
    if database is None:
        return []
    return [ms / 1e3 for ms in wait_for_records(database, since, count)]
