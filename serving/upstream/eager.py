"""A coroutine run at once, outside any task, as far as it goes without waiting: the relay
starts the client's send from the upstream socket's callback this way, and only a send that
must wait (a client reading slower than the replica writes) is finished in a task."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

Result = TypeVar("Result")


class Unfinished:
    """A coroutine started by hand (`start`) that had to wait: awaiting this runs the rest
    of it in the awaiting task, which gets what it waits on, its result and its
    cancellation."""

    __slots__ = ("coroutine", "waiting_on")

    def __init__(self, coroutine: Any, waiting_on: Any) -> None:
        self.coroutine, self.waiting_on = coroutine, waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        value = self.waiting_on
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                self.coroutine.close()
                raise
            except BaseException as exc:  # a cancellation, handed on
                try:
                    value = self.coroutine.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = self.coroutine.send(sent)
                except StopIteration as stop:
                    return stop.value

    def close(self) -> None:
        """Abandon it (the awaiting task was cancelled before it got to it)."""
        self.coroutine.close()


def start(awaitable: Awaitable[None]) -> Awaitable[None] | None:
    """Run a coroutine now, outside any task, as far as it goes without waiting: None when
    it finished (an ASGI server's send that writes to the socket at once), else the
    Unfinished rest to await. Any other awaitable is returned to be awaited."""
    send_to = getattr(awaitable, "send", None)
    if send_to is None:
        return awaitable
    try:
        waiting_on = send_to(None)
    except StopIteration:
        return None
    return Unfinished(awaitable, waiting_on)


def run_eagerly(coroutine: Coroutine[Any, Any, Result]) -> asyncio.Future[Result]:
    """Run a coroutine now, outside any task, as far as it goes without waiting: a
    finished future when it ended there (its result or its error), else a task that runs
    the rest (cancelling it cancels the coroutine, or closes it when the task is cancelled
    before its first step). A short answer relayed whole this way costs no task.

    Until it first waits, the coroutine runs in the caller's task: it must not rely on
    `asyncio.current_task()` there (`asyncio.timeout` would cancel the caller)."""
    loop = asyncio.get_running_loop()
    try:
        waiting_on = coroutine.send(None)
    except StopIteration as stop:
        finished: asyncio.Future[Result] = loop.create_future()
        finished.set_result(stop.value)
        return finished
    except Exception as exc:
        failed: asyncio.Future[Result] = loop.create_future()
        failed.set_exception(exc)
        return failed
    unfinished = Unfinished(coroutine, waiting_on)
    task = loop.create_task(_rest(unfinished))
    task.add_done_callback(lambda done: unfinished.close() if done.cancelled() else None)
    return task


async def _rest(unfinished: Unfinished) -> Any:
    return await unfinished
