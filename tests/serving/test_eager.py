"""A coroutine run eagerly (serving/upstream/eager.py): a short answer relayed whole costs
no task, and one that must wait runs on in a task that cancelling stops."""

from __future__ import annotations

import asyncio

import pytest

from serving.upstream import run_eagerly


def test_a_coroutine_that_never_waits_is_finished_without_a_task() -> None:
    async def whole() -> str:
        return "done"

    async def main() -> None:
        before = len(asyncio.all_tasks())
        future = run_eagerly(whole())
        assert future.done() and future.result() == "done"
        assert not isinstance(future, asyncio.Task)
        assert len(asyncio.all_tasks()) == before

    asyncio.run(main())


def test_an_error_raised_before_waiting_is_the_futures_error() -> None:
    async def failing() -> None:
        raise ValueError("the replica said no")

    async def main() -> None:
        future = run_eagerly(failing())
        assert future.done()
        with pytest.raises(ValueError, match="the replica said no"):
            future.result()

    asyncio.run(main())


def test_a_coroutine_that_waits_runs_on_in_a_task_and_cancelling_it_stops_it() -> None:
    steps: list[str] = []

    async def waits(gate: asyncio.Event) -> str:
        steps.append("began")
        try:
            await gate.wait()
        except asyncio.CancelledError:
            steps.append("cancelled")
            raise
        finally:
            steps.append("ended")
        return "after"

    async def main() -> None:
        gate = asyncio.Event()
        first = run_eagerly(waits(gate))
        assert steps == ["began"] and not first.done()  # ran up to its wait, at once
        gate.set()
        assert await first == "after"
        assert steps == ["began", "ended"]

        waiting = run_eagerly(waits(asyncio.Event()))
        await asyncio.sleep(0)  # its task has taken its first step
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert steps[2:] == ["began", "cancelled", "ended"]

        # Cancelled before its task's first step: the coroutine is closed, not left
        # suspended (its clean-up runs now, not whenever it is collected).
        at_once = run_eagerly(waits(asyncio.Event()))
        at_once.cancel()
        with pytest.raises(asyncio.CancelledError):
            await at_once
        assert steps[5:] == ["began", "ended"]

    asyncio.run(main())
