"""One event loop's gateway resources (serving/gateway/resources.py): its background tasks
run once each for the life of the loop, and one that ended is started again by the next
request."""

from __future__ import annotations

import asyncio
from typing import Any

from serving.gateway.resources import LiveStreams, Resources
from serving.router import Router


def test_a_background_task_runs_once_and_one_that_ended_is_started_again() -> None:
    starts: list[str] = []

    async def steady(_resources: Any) -> None:
        starts.append("steady")
        await asyncio.Event().wait()

    async def failing(_resources: Any) -> None:
        starts.append("failing")
        raise RuntimeError("the watcher fell over")

    async def main() -> None:
        resources = Resources(asyncio.get_running_loop(), Router(), LiveStreams())
        resources.work = {"steady": steady, "failing": failing}
        for _ in range(3):  # three requests in one turn of the loop
            resources.keep_background()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sorted(starts) == ["failing", "steady"]
        resources.keep_background()  # the next request: the one that ended starts again
        await asyncio.sleep(0)
        assert sorted(starts) == ["failing", "failing", "steady"]
        for task in resources.background.values():
            task.cancel()
        await asyncio.gather(*resources.background.values(), return_exceptions=True)

    asyncio.run(main())
