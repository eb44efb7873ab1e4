"""A coroutine run at once, outside any task, as far as it goes without waiting: the relay
starts the client's send from the upstream socket's callback this way, and only a send that
must wait (a client reading slower than the replica writes) is finished in a task."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from typing import Any


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
