"""A STAND-IN Kubernetes API server for tests: the `kmock` emulator (no real API server
can run on these machines), on its own event loop in a thread so that the synchronous
`kubernetes` client can call it. kmock does not do server-side apply; the subclass below
makes an apply of a missing object create it (a later apply merges, as kmock's patch does),
which is enough for the backend's create-or-update calls. It ignores label selectors, so
the code under test filters by labels itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import kmock


class ApplyingEmulator(kmock.KubernetesEmulator):
    async def _handle(self, request: Any) -> Any:
        content_type = request.headers.get("Content-Type", "")
        if (request.action == kmock.action.UPDATE and request.name
                and request.subresource is None
                and content_type.startswith("application/apply-patch")):
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                request.data.setdefault("metadata", {})["namespace"] = request.namespace
                object.__setattr__(request, "action", kmock.action.CREATE)
        return await super()._handle(request)


class EmulatedCluster:
    """kmock serving on 127.0.0.1 from a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        self.emulator: ApplyingEmulator | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.main(),), daemon=True)

    async def main(self) -> None:
        self.stopping = asyncio.Event()
        async with ApplyingEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            for resource in ("v1/pods", "v1/services", "apps/v1/deployments",
                             "policy/v1/poddisruptionbudgets",
                             "autoscaling/v2/horizontalpodautoscalers"):
                # Listed empty, not 404, before any object of the kind exists.
                emulator.resources[resource] = {}  # type: ignore[assignment]
            self.ready.set()
            await self.stopping.wait()

    def start(self) -> EmulatedCluster:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the emulated API server did not start")
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run on the emulator's loop (its objects and DSL are not thread-safe)."""
        async def run() -> Any:
            return function(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            assert self.emulator is not None
            try:
                stored = self.emulator.objects[resource, namespace, name]
            except KeyError:
                return None
            return None if stored.deleted else dict(stored)

        result: dict[str, Any] | None = self.call(read)
        return result
