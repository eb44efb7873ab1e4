"""Whether the SQLite database has taken a commit the reconciler's change watch has not
looked past, told without a query.

SQLite in its rollback-journal mode (the default, and this project's) adds one to a
counter in the database file's header (bytes 24-27, big-endian) on every commit, whatever
process makes it. The change watch (controlplane/reconciler/schedule.py) reads the
counter just before its query of the audit log; a commit this process makes that writes
no audit event another process must be told of (usage records, the reconciler's health
records: `eventless_transaction`) is remembered here by the value it left, when nobody
else committed between (the counter went up by exactly one across it). While every
commit since the watch's read is one of those (`unchanged_since`), its query would find
nothing new: it is not run, and the controllers skip handing a pass with nothing else to
do to a worker thread just to run it (controlplane/controllers.py).

Reading the header is a stat and a 28-byte read of a local file, through a descriptor
the process keeps open (closing one would drop the process's SQLite locks on the file):
cheap enough for the event loop. Anything unexpected (not SQLite, an in-memory database,
a file that cannot be read, write-ahead-log mode, where the header counts no commits)
reads as None, and None never counts as unchanged: the pass then runs as it always did.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.conf import settings

_MAGIC = b"SQLite format 3\x00"
_LEGACY = 1  # header byte 18: 1 rollback journal, 2 write-ahead log


def database_file(database: Mapping[str, Any]) -> str | None:
    """A database's file (settings.DATABASES' entry), when it is a SQLite file."""
    if not str(database.get("ENGINE", "")).endswith("sqlite3"):
        return None
    name = str(database.get("NAME") or "")
    if not name or name == ":memory:" or name.startswith("file:") or "mode=memory" in name:
        return None
    return name


# A descriptor of each database file read, by path, with the file's (device, inode):
# kept open for the life of the process, never closed. POSIX drops every lock a process
# holds on a file when it closes any descriptor of that file, so a read that closed its
# own would free the locks SQLite's connections in this process hold on the database (a
# transaction's write lock among them: the usage writer reads the counter inside its
# transaction), and another process could write at the same time and corrupt it.
_descriptors: dict[str, tuple[int, int, int]] = {}
_descriptors_lock = threading.Lock()


def _descriptor(path: str) -> int:
    """This process's descriptor of the file now at `path`, opened on the first read and
    again when another file has taken the path (the one before is left open: closing
    it would drop the locks of a connection still on that file)."""
    now = os.stat(path)
    with _descriptors_lock:
        kept = _descriptors.get(path)
        if kept is not None and kept[1:] == (now.st_dev, now.st_ino):
            return kept[0]
        fd = os.open(path, os.O_RDONLY)
        opened = os.fstat(fd)  # the file opened, whatever took the path meanwhile
        _descriptors[path] = (fd, opened.st_dev, opened.st_ino)
        return fd


def counter() -> int | None:
    """The database file's commit counter now; None where it cannot be told."""
    # The default database (the test runner's too: it changes the same settings).
    path = database_file(settings.DATABASES["default"])
    if path is None:
        return None
    try:
        header = os.pread(_descriptor(path), 28, 0)
    except OSError:
        return None
    if len(header) < 28 or not header.startswith(_MAGIC) or header[18] != _LEGACY:
        return None
    return int.from_bytes(header[24:28], "big")


# Own commits remembered, and the most a check walks: a watch that looked further back
# than that queries again.
OWN_KEPT = 1024


class CommitWatch:
    """This process's own commits that hold no audit event, by the counter value each
    left; a watch that looked at counter value N can then tell whether every commit
    since was one of those."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.own: set[int] = set()

    def own_commit(self, before: int | None) -> None:
        """This process just committed a transaction that wrote no audit event;
        `before` is the counter read inside it, after its writes (the transaction held
        the write lock then, so no other commit could come between that read and its
        own). Read again now: one more means the commit was this one alone."""
        if before is None:
            return
        after = counter()
        if after != before + 1:
            return
        with self.lock:
            self.own.add(after)
            if len(self.own) > 2 * OWN_KEPT:
                self.own = {n for n in self.own if n > after - OWN_KEPT}

    def unchanged_since(self, looked: int | None) -> bool:
        """Every commit since the counter read `looked` was one of this process's own
        event-less ones (none at all, or only those); False whenever that cannot be
        told."""
        now = counter()
        if looked is None or now is None or not 0 <= now - looked <= OWN_KEPT:
            return False
        with self.lock:
            return all(n in self.own for n in range(looked + 1, now + 1))


commits = CommitWatch()


@contextmanager
def eventless_transaction() -> Iterator[None]:
    """A transaction of this process that writes no audit event another process would
    need to be told of (usage records, the reconciler's own health records): committed,
    it leaves the change watch quiet. Nested in another transaction it commits nothing
    itself, and counts for nothing. One that changed no row counts for nothing either:
    its commit leaves the counter where it was, so a commit by another process right
    after it would read as this one's."""
    from django.db import connection, transaction

    with transaction.atomic():
        handle = connection.connection
        changes = getattr(handle, "total_changes", None)  # SQLite's rows changed so far
        yield
        wrote = changes is not None and handle.total_changes != changes
        # The write lock is held once a row is written: no other commit comes between.
        before = counter() if wrote else None
    commits.own_commit(before)
