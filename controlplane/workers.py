"""`manage.py serve --workers N`: N gateway worker processes on one port, the controllers
once, in the supervising process.

Each worker is a `manage.py serve --no-controllers` of its own (the gateway, pages, REST
API and WebSockets) that binds the port with SO_REUSEPORT: the kernel hashes each new
connection to one worker's accept queue, so connections spread evenly whatever each
worker's event loop is doing. (With one listening socket shared by every worker, each
connection wakes every worker's epoll and the first to call accept() takes it; on Linux
that piles connections onto whichever process happens to be waiting, the reason nginx
added `reuseport`.) Everything the workers must agree on travels through Redis, as between
the processes of a scale-out (docs/operations.md, "Worker processes"), so more than one
worker requires REDIS_URL. Their Prometheus metrics are kept in prometheus_client's
multiprocess mode (files in a private folder made at start and removed at the end), so
/metrics, whichever worker answers it, sums them.

The supervisor starts the workers in their own sessions (a Ctrl-C in a terminal reaches
the supervisor alone, which then stops each worker once, gracefully) and each worker asks
the kernel for SIGTERM should the supervisor die (Linux `PR_SET_PDEATHSIG`), so no worker
outlives it. A worker that dies is started again; one that dies within
CRASH_LOOP_SECONDS of its start (a port taken, a broken setting) stops the whole server,
with exit status 1, rather than being restarted forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from django.core.management.base import CommandError

logger = logging.getLogger(__name__)

#: Tells a worker which process supervises it (it leaves when that one has gone).
SUPERVISOR_VARIABLE = "FLEETPLANE_SUPERVISOR_PID"
#: prometheus_client's multiprocess folder (read when it is imported, so set at spawn).
METRICS_FOLDER_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
CRASH_LOOP_SECONDS = 10.0
MANAGE = str(Path(__file__).resolve().parent.parent / "manage.py")
PR_SET_PDEATHSIG = 1


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, for one worker (uvicorn listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def check_port(host: str, port: int) -> None:
    """Fail before any worker starts when the port is held by a server that does not
    share it."""
    try:
        reuse_port_socket(host, port).close()
    except OSError as exc:
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def follow_supervisor() -> None:
    """In a worker: be sent SIGTERM when the supervisor dies, and leave at once if it
    already has (between the spawn and this call)."""
    expected = os.environ.get(SUPERVISOR_VARIABLE)
    if not expected:
        return
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(expected):
        raise CommandError("the supervising `manage.py serve` has gone")


class Supervisor:
    """Keeps `count` workers running until stopped."""

    def __init__(self, arguments: list[str], count: int) -> None:
        self.arguments = arguments  # `serve` options of every worker
        self.count = count
        self.metrics_folder = Path(tempfile.mkdtemp(prefix="fleetplane-metrics-"))
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self.failure = ""

    def environment(self) -> dict[str, str]:
        return {**os.environ, METRICS_FOLDER_VARIABLE: str(self.metrics_folder),
                SUPERVISOR_VARIABLE: str(os.getpid())}

    async def keep(self, index: int, stop: asyncio.Event) -> None:
        """Run worker `index` until the server stops, starting it again when it dies."""
        while not self.stopping:
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                sys.executable, MANAGE, "serve", *self.arguments, "--worker-index",
                str(index), env=self.environment(), start_new_session=True)
            self.processes[index] = process
            if self.stopping:  # stopped while it was being started
                self.signal(process)
            code = await process.wait()
            self.forget(process.pid)
            if self.stopping:
                return
            lived = time.monotonic() - started
            if lived < CRASH_LOOP_SECONDS:
                self.failure = (f"gateway worker {index} (pid {process.pid}) exited with "
                                f"status {code} {lived:.1f} s after it started: stopping")
                logger.error("%s", self.failure)
                stop.set()
                return
            logger.error("gateway worker %d (pid %d) exited with status %s: starting it "
                         "again", index, process.pid, code)

    def signal(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)

    def terminate(self) -> None:
        """Ask every worker to stop (once each: uvicorn takes a second signal as
        'cut the streams now')."""
        self.stopping = True
        for process in self.processes.values():
            self.signal(process)

    def forget(self, pid: int) -> None:
        """A dead worker's in-flight and queued gauges leave /metrics' sums (its counters
        stay: totals never go down)."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_folder))

    def close(self) -> None:
        shutil.rmtree(self.metrics_folder, ignore_errors=True)


async def serve_workers(arguments: list[str], count: int, *, controllers: bool) -> int:
    """Run the workers (and the controllers, unless told not to) until SIGINT or SIGTERM;
    the exit status: 0, or 1 when a worker kept failing."""
    from controlplane.controllers import run_controllers

    supervisor = Supervisor(arguments, count)
    stop, controllers_stop = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    workers = [loop.create_task(supervisor.keep(index, stop)) for index in range(count)]
    running = loop.create_task(run_controllers(controllers_stop)) if controllers else None
    try:
        await stop.wait()
        # Each worker lets its requests in flight finish and writes their usage records;
        # then the controllers stop. Replica processes keep running, as with one process.
        supervisor.terminate()
        await asyncio.gather(*workers, return_exceptions=True)
    finally:
        controllers_stop.set()
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        supervisor.close()
    return 1 if supervisor.failure else 0
