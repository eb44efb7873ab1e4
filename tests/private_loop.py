"""An event loop of a test's own for the in-process gateway, closed so that nothing it
started still writes to the database when the test's database is emptied."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


def private_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Yield a new loop; afterwards write the usage the gateway holds on it, wait for
    every batch being written (in a worker thread, which cancelling its task does not
    stop: an INSERT racing PostgreSQL's TRUNCATE of a transactional test deadlocks),
    then cancel what is left (the load watcher, the usage writer) and close it."""
    running = asyncio.new_event_loop()
    yield running
    from serving.gateway import gateway

    resources = gateway.current_resources
    if resources is not None and resources.loop is running:
        writer = resources.usage

        async def written() -> None:
            with contextlib.suppress(TimeoutError):  # a database out of reach: as before
                async with asyncio.timeout(10):
                    while writer.writing or writer.buffer:
                        await writer.flush() if writer.buffer else await asyncio.sleep(0.02)

        running.run_until_complete(written())
    left = asyncio.all_tasks(running)
    for task in left:
        task.cancel()

    async def finish() -> None:  # gather() of nothing would make a future on another loop
        await asyncio.gather(*left, return_exceptions=True)

    running.run_until_complete(finish())
    running.run_until_complete(running.shutdown_asyncgens())
    running.close()
