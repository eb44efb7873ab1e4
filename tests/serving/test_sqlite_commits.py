"""The SQLite commit counter (serving/sqlite_commits.py): a commit by anyone else is seen,
this process's own event-less commits are not counted as changes, and whatever cannot be
told (write-ahead log, an in-memory database, not SQLite) never reads as unchanged."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import sqlite_commits
from serving.sqlite_commits import CommitWatch, counter


def use_file(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """The counter read from `path`, as from the default database's file."""
    monkeypatch.setattr(sqlite_commits.settings, "DATABASES", {"default": {
        "ENGINE": "django.db.backends.sqlite3", "NAME": path}})


@pytest.fixture
def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "db.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    use_file(monkeypatch, path)
    return path


def commit(path: Path) -> None:
    """A commit as another process makes it: its own connection."""
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO t VALUES (1)")


def own_commit(path: Path, watch: CommitWatch, *, other_after: bool = False) -> None:
    """A commit of this process bracketed as the usage writer brackets it."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO t VALUES (2)")
    before = counter()
    db.execute("COMMIT")
    db.close()
    if other_after:
        commit(path)
    watch.own_commit(before)


def test_a_commit_by_anyone_else_is_seen(database: Path) -> None:
    watch = CommitWatch()
    assert not watch.unchanged_since(None)  # never looked
    looked = counter()
    assert watch.unchanged_since(looked)
    commit(database)
    assert not watch.unchanged_since(looked)
    assert watch.unchanged_since(counter())


def test_an_own_commit_without_events_leaves_it_unchanged(database: Path) -> None:
    watch = CommitWatch()
    looked = counter()
    for _ in range(3):
        own_commit(database, watch)
    assert watch.unchanged_since(looked)


def test_an_own_commit_with_another_right_after_it_is_a_change(database: Path) -> None:
    watch = CommitWatch()
    looked = counter()
    own_commit(database, watch, other_after=True)
    assert not watch.unchanged_since(looked)
    own_commit(database, watch)
    assert not watch.unchanged_since(looked)  # the other one is still between


def test_an_own_commit_after_an_unseen_one_is_still_a_change(database: Path) -> None:
    watch = CommitWatch()
    looked = counter()
    assert looked is not None
    commit(database)
    own_commit(database, watch)
    assert not watch.unchanged_since(looked)
    assert watch.unchanged_since(looked + 1)  # a watch that looked after it


def test_a_write_ahead_log_database_is_never_unchanged(database: Path) -> None:
    assert counter() is not None
    with sqlite3.connect(database) as db:
        assert db.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    assert counter() is None and not CommitWatch().unchanged_since(None)


@pytest.mark.parametrize(("engine", "name"), [
    ("django.db.backends.sqlite3", ":memory:"),
    ("django.db.backends.sqlite3", "file:memorydb_default?mode=memory&cache=shared"),
    ("django.db.backends.sqlite3", ""),
    ("django.db.backends.postgresql", "test"),
])
def test_a_database_that_is_not_a_sqlite_file_has_no_file(engine: str, name: str) -> None:
    assert sqlite_commits.database_file({"ENGINE": engine, "NAME": name}) is None


@pytest.mark.parametrize("content", [None, b"x" * 200, b"SQLite format 3\x00"])
def test_a_file_that_cannot_be_read_as_sqlite_is_never_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes | None) -> None:
    path = tmp_path / "db.sqlite3"  # missing, not SQLite, a header cut short
    if content is not None:
        path.write_bytes(content)
    use_file(monkeypatch, path)
    assert counter() is None and not CommitWatch().unchanged_since(None)


@pytest.mark.sqlite_file
@pytest.mark.django_db(transaction=True)
def test_the_usage_writer_commits_as_its_own() -> None:
    from serving.usage import Usage, write_batch

    assert counter() is not None, "the test database is not a SQLite file"
    looked = counter()
    written = write_batch([Usage(at=time.time(), request_id=f"r{n}", key_id=None,
                                 model="fake", deployment="demo", replica="demo-1",
                                 status=200, stream=False, prompt_tokens=1,
                                 completion_tokens=1, queue_ms=0.0, ttft_ms=1.0,
                                 itl_ms=None, e2e_ms=2.0) for n in range(3)])
    assert written == 3 and looked is not None
    assert counter() == looked + 1
    assert sqlite_commits.commits.unchanged_since(looked)


def test_a_watch_that_looked_long_ago_queries_again(database: Path) -> None:
    watch = CommitWatch()
    looked = counter()
    assert looked is not None
    db = sqlite3.connect(database, isolation_level=None)
    for _ in range(sqlite_commits.OWN_KEPT + 1):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t VALUES (3)")
        before = counter()
        db.execute("COMMIT")
        watch.own_commit(before)
    db.close()
    assert not watch.unchanged_since(looked)  # further back than it walks
    assert watch.unchanged_since(looked + 1)


@pytest.mark.sqlite_file
@pytest.mark.django_db(transaction=True)
def test_a_transaction_that_changed_no_row_is_not_counted_as_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its commit leaves the counter as it was: a commit by another process landing
    right after it (before the counter is read again) must not pass for this one."""
    from django.db import connection

    from controlplane.models import AuditEvent
    from serving.sqlite_commits import eventless_transaction

    assert counter() is not None, "the test database is not a SQLite file"
    watch = sqlite_commits.commits
    own_commit = watch.own_commit

    def another_process_commits_first(before: int | None) -> None:
        with sqlite3.connect(connection.settings_dict["NAME"]) as other:
            (version,) = other.execute("PRAGMA user_version").fetchone()
            other.execute(f"PRAGMA user_version = {version + 1}")  # a commit, nothing read
        own_commit(before)

    monkeypatch.setattr(watch, "own_commit", another_process_commits_first)
    looked = counter()
    assert looked is not None
    with eventless_transaction():
        assert AuditEvent.objects.filter(pk=-1).update(count=2) == 0
    assert counter() == looked + 1  # the other process's commit alone
    assert not watch.unchanged_since(looked)


def take_write_lock_elsewhere(path: Path) -> subprocess.CompletedProcess[str]:
    """Another process asking at once for the write lock (BEGIN IMMEDIATE, no wait)."""
    return subprocess.run([sys.executable, "-c", (
        "import sqlite3, sys\n"
        "db = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE')\n"
        "db.execute('INSERT INTO t VALUES (3)')\n"
        "db.execute('COMMIT')\n"), str(path)], capture_output=True, text=True, timeout=60)


def test_reading_the_counter_leaves_this_process_its_locks(database: Path) -> None:
    # POSIX drops every lock a process holds on a file when it closes any descriptor of
    # that file: a read of the header that closed its descriptor would free the write
    # lock of the transaction it is read in, and another process could write at once.
    db = sqlite3.connect(database, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t VALUES (2)")
        for _ in range(3):
            assert counter() is not None
        other = take_write_lock_elsewhere(database)
        assert other.returncode != 0 and "database is locked" in other.stderr
        db.execute("COMMIT")
    finally:
        db.close()
    assert take_write_lock_elsewhere(database).returncode == 0  # free once committed
    with sqlite3.connect(database) as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert check.execute("SELECT x FROM t ORDER BY x").fetchall() == [(2,), (3,)]


def test_a_database_file_made_anew_is_read_anew(database: Path) -> None:
    looked = counter()
    assert looked is not None
    database.unlink()
    with sqlite3.connect(database) as db:  # another file at the same path
        db.execute("CREATE TABLE t (x INTEGER)")
        for _ in range(5):
            db.execute("INSERT INTO t VALUES (1)")
            db.commit()
    now = counter()
    assert now is not None and now != looked
    commit(database)
    assert counter() == now + 1
