"""An event loop of a test's own for the in-process gateway, closed so that nothing it
started still writes to the database when the test's database is emptied; and the wait
for the gateway's usage writer that both this and tests/serving/conftest.py use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any


async def all_written(writer: Any, seconds: float = 10.0) -> None:
    """Once the usage writer holds nothing and writes nothing (a batch in a worker thread,
    which cancelling its task does not stop: an INSERT racing PostgreSQL's TRUNCATE of a
    transactional test deadlocks); after `seconds` regardless (a database out of reach)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while writer.writing or writer.buffer:
                if writer.buffer:
                    await writer.flush()
                else:
                    await asyncio.sleep(0.02)


def private_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Yield a new loop; afterwards write the usage the gateway holds on it and wait for
    it (`all_written`), then cancel what is left (the load watcher, the usage writer) and
    close it."""
    running = asyncio.new_event_loop()
    yield running
    from serving.gateway import gateway

    resources = gateway.current_resources
    if resources is not None and resources.loop is running:
        running.run_until_complete(all_written(resources.usage))
    left = asyncio.all_tasks(running)
    for task in left:
        task.cancel()

    async def finish() -> None:  # gather() of nothing would make a future on another loop
        await asyncio.gather(*left, return_exceptions=True)

    running.run_until_complete(finish())
    running.run_until_complete(running.shutdown_asyncgens())
    running.close()
