"""Whether the controllers are stuck, for the kubelet and for the leader election.

The controllers' loop beats a heartbeat at the end of each reconcile pass, and a process
waiting for the Lease beats it after each election attempt. A process whose heartbeat is
older than its bound is stuck (a pass hung on a lock, a socket without a timeout, a full
thread pool): its liveness check fails, so the kubelet restarts it, and the leader stops
renewing the Lease (controlplane/leader.py), so a standby takes over.

`manage.py run_controllers --health-port` serves the checks over HTTP:

- `/livez`: 200 while the last pass (or election attempt) is younger than the bound,
  503 once it is older.
- `/readyz`: as `/livez`, and 503 until the first pass or election attempt has completed.

The server runs on the controllers' own event loop: a loop that no longer runs cannot
answer, which fails the check too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import orjson

logger = logging.getLogger(__name__)

# A pass every RECONCILE_INTERVAL_SECONDS (1 s by default) and an election attempt every
# third of the Lease (5 s, each request bounded by that too): 3 intervals plus this much
# slack covers a slow pass and a slow election attempt.
# Beyond three passes: the longest one step of a pass may take (a replica's warm-up request
# is bounded at 60 s, a Kubernetes API call at 30 s), so a slow step is not a stall.
DEFAULT_STALL_SLACK_SECONDS = 75.0


class Heartbeat:
    """When the controllers last made progress (monotonic time)."""

    def __init__(self, stall_seconds: float = 3.0 + DEFAULT_STALL_SLACK_SECONDS) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._beats = 0
        self.what = "started"
        self.stall_seconds = stall_seconds

    def beat(self, what: str) -> None:
        """A pass or an election attempt completed (callable from any thread)."""
        with self._lock:
            self._last = time.monotonic()
            self._beats += 1
            self.what = what

    def restart(self) -> None:
        """Start counting again, as a new process does (no beat yet)."""
        with self._lock:
            self._last = time.monotonic()
            self._beats = 0
            self.what = "started"

    def age(self) -> float:
        with self._lock:
            return time.monotonic() - self._last

    def report(self) -> tuple[bool, bool, dict[str, object]]:
        """(live, ready, what the checks answer)."""
        with self._lock:
            age, beats, what = time.monotonic() - self._last, self._beats, self.what
        live = age <= self.stall_seconds
        ready = live and beats > 0
        body: dict[str, object] = {
            "status": "ok" if ready else ("starting" if live else "stalled"),
            "last": what, "seconds_since_last": round(age, 3),
            "bound_seconds": self.stall_seconds}
        if not live:
            body["detail"] = (f"no reconcile pass or election attempt completed for "
                              f"{age:.1f} s (bound {self.stall_seconds:g} s)")
        elif not ready:
            body["detail"] = "no reconcile pass or election attempt has completed yet"
        return live, ready, body


#: The controllers of this process.
heartbeat = Heartbeat()


def default_stall_seconds(reconcile_interval: float) -> float:
    """How long the controllers may go without a beat before they count as stalled."""
    return 3 * reconcile_interval + DEFAULT_STALL_SLACK_SECONDS


async def serve_health(beat: Heartbeat, host: str, port: int,
                       stop: asyncio.Event) -> None:
    """Answer /livez and /readyz on host:port until stop is set."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            # The headers are not needed; they are read so the client sees a clean close.
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (
                    b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            live, ready, body = beat.report()
            if path == "/livez":
                status = 200 if live else 503
            elif path == "/readyz":
                status = 200 if ready else 503
            else:
                status, body = 404, {"detail": "not found: /livez and /readyz are served"}
            payload = orjson.dumps(body)
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                         .encode() + payload)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(answer, host, port)
    logger.info("controller health checks on %s:%d (/livez, /readyz; bound %.0f s)",
                host, port, beat.stall_seconds)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
