"""Health probes of endpoints, over the gateway's own upstream client (serving/upstream/)
on one event loop thread of the process, asked from the reconciler's probe threads.

A general client's pool does not scale to a fleet's endpoints: httpx's pool looks at every
connection it holds on every request, so with a hundred answering endpoints the probes
spent most of their time in that scan (py-spy, bench/fleet_scale.py). The upstream client
keeps its connections per host (bench/probe_calls.py compares one probe each way)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from serving.upstream import ConnectionPool, UpstreamError, UpstreamStalled


class ProbeFailed(Exception):
    """The endpoint did not answer: `kind` names how (ConnectError, Timeout, ...)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class ProbeClient:
    """GETs to endpoints from any thread, each bounded by its own timeout."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool: ConnectionPool | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="probe-io",
                                       daemon=True)
        self.thread.start()

    async def _status(self, base_url: str, path: str, headers: tuple[tuple[str, str], ...],
                      timeout: float) -> int:
        if self.pool is None:
            self.pool = ConnectionPool()
        try:
            async with asyncio.timeout(timeout):
                response = await self.pool.request("GET", base_url, path, headers=headers,
                                                   head_timeout=timeout,
                                                   idle_timeout=timeout)
                try:
                    await response.read()  # read whole, so the connection is kept
                finally:
                    response.release()
        except (TimeoutError, UpstreamStalled):
            raise ProbeFailed("Timeout", f"no answer within {timeout:g} s") from None
        except UpstreamError as exc:
            text = str(exc)
            kind = "ConnectError" if text.startswith(("cannot connect", "no connection")) \
                else "ProtocolError"
            raise ProbeFailed(kind, text) from None
        return response.status

    def status(self, base_url: str, path: str, headers: tuple[tuple[str, str], ...] = (),
               timeout: float = 5.0) -> int:
        """The HTTP status of GET `base_url` + `path`; ProbeFailed when none came."""
        future = asyncio.run_coroutine_threadsafe(
            self._status(base_url, path, headers, timeout), self.loop)
        try:
            return future.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ProbeFailed("Timeout", f"no answer within {timeout:g} s") from None


_client: ProbeClient | None = None
_lock = threading.Lock()


def shared() -> ProbeClient:
    """The process's probe client, started on first use."""
    global _client
    with _lock:
        if _client is None:
            _client = ProbeClient()
        return _client
