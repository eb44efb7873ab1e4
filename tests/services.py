"""PRIVATE real servers for outage tests: a `redis-server` and a PostgreSQL cluster of the
test's own, on free ports, that a test may stop and start again on the same port. The
shared servers (6379, 5432) are never touched. Each is stopped and its folder removed when
the fixture ends, whatever the test did. A missing binary skips the test with its name."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.processes import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
START_SECONDS = 30.0


def _wait_until(what: str, check: object, seconds: float = START_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} within {seconds:.0f} s")


@dataclass
class PrivateRedis:
    """A `redis-server` with nothing saved to disk, on its own port and folder."""

    port: int
    folder: Path
    process: subprocess.Popen[bytes] | None = None
    options: tuple[str, ...] = ()  # more of redis-server's, e.g. ("--requirepass", "...")

    @property
    def url(self) -> str:
        return self.database_url(0)

    def database_url(self, db: int) -> str:
        """The URL of one of its numbered databases."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.folder),
             "--logfile", str(self.folder / "redis.log"), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_until("the private Redis answered PING", self.answers)

    def stop(self) -> None:
        """Stop the server (its data goes with it: nothing is saved)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.process = None

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.AuthenticationError:
            return True  # it answers, and wants a password
        except redis.RedisError:
            return False


@dataclass
class PrivatePostgres:
    """A PostgreSQL 15 cluster of its own (trust authentication, a database `test`),
    run as the `postgres` user: initdb refuses root."""

    port: int
    folder: Path

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/test"

    def _as_postgres(self, *command: str) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *command], capture_output=True, text=True,
                              timeout=120, check=True)

    def create(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust",
                          "-U", "postgres", "--no-sync")
        self.start()
        self._as_postgres(str(PG_BIN / "createdb"), "-h", str(self.folder), "-p",
                          str(self.port), "-U", "postgres", "test")

    def start(self) -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l",
                          str(self.folder / "postgres.log"), "-o",
                          f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                          "-c fsync=off", "-w", "start")
        _wait_until("the private PostgreSQL accepted connections", self.answers)

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in an outage."""
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                          "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def answers(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres "
                                 "dbname=postgres", connect_timeout=2):
                return True
        except psycopg.Error:
            return False


def _require(*binaries: str) -> None:
    for binary in binaries:
        if not (shutil.which(binary) or Path(binary).exists()):
            # Never a skip: an outage test that does not run proves nothing. The machine's
            # packages provide these (Debian's redis-server and postgresql).
            pytest.fail(f"{binary} is not installed: the outage tests need a real server "
                        f"of their own (install Debian's redis-server and postgresql)",
                        pytrace=False)


@contextlib.contextmanager
def private_redis(*options: str) -> Iterator[PrivateRedis]:
    _require("redis-server")
    folder = Path(tempfile.mkdtemp(prefix="fleetplane-redis-"))
    server = PrivateRedis(free_port(), folder, options=options)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    _require(str(PG_BIN / "initdb"), str(PG_BIN / "pg_ctl"))
    if os.geteuid() == 0:
        _require("runuser")
    folder = Path(tempfile.mkdtemp(prefix="fleetplane-pg-"))
    server = PrivatePostgres(free_port(), folder)
    try:
        server.create()
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            if server.running():
                server.stop()
        shutil.rmtree(folder, ignore_errors=True)
