"""Priority admission: when every replica of a deployment (or of one of its context
pools) holds as many requests as it may, further requests wait here, in a queue per
deployment and pool, taken in priority order, then arrival order.

Each waiting request ranks by its class's level minus one level per
GATEWAY_QUEUE_AGING_SECONDS waited, so a lower class moves up the longer it waits and
never starves. A class may fill only its `share` of the slots (serving/priority.py): the
rest is headroom that more urgent classes take at once. A class's queue is bounded in
length (`max_queued`: a full queue answers 429) and in wait (`max_wait_seconds`: an
expired wait answers 503); both carry a Retry-After estimated from the measured service
rate (requests finished per second). One owner (an API key, a playground user) may hold at
most GATEWAY_KEY_QUEUE_SHARE of a class's queue, so one busy key cannot fill it for the
others (429 `key_queue_full`).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from serving.hot_settings import hot
from serving.priority import PriorityClass

RATE_WINDOW = 30.0  # seconds of finished requests the service rate is measured over


class Refused(Exception):
    """The queue cannot take the request (`full`) or it waited too long."""

    def __init__(self, status: int, message: str, retry_after: float, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after, self.code = (
            status, message, retry_after, code)


@dataclass
class Waiter:
    """A request waiting in a lane."""

    priority: PriorityClass
    arrived: float
    order: int
    future: asyncio.Future[None]
    owner: str | None = None

    def rank(self, now: float, aging: float) -> tuple[float, int]:
        """Its place in line: its class's level, less one per aging period waited."""
        return (self.priority.level - (now - self.arrived) / aging, self.order)


@dataclass
class Ticket:
    """A request let through: where it stood and how long it waited."""

    lane: str
    position: int  # 0: went straight through
    estimated_wait: float
    waited: float = 0.0

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The x-queue-* headers of the answer."""
        return [(b"x-queue-position", str(self.position).encode()),
                (b"x-queue-wait-ms", str(round(self.waited * 1000)).encode()),
                (b"x-queue-estimated-wait-ms",
                 str(round(self.estimated_wait * 1000)).encode())]


@dataclass
class Lane:
    """One deployment's (or context pool's) slots and queue: one queue per class, in
    arrival order. Within a class arrival order is rank order (every waiter ages at the
    same pace), so the best waiter is always one of the few heads."""

    capacity: int = 0
    busy: int = 0
    queues: dict[str, deque[Waiter]] = field(default_factory=dict)
    finished: deque[float] = field(default_factory=deque)
    # (owner, class) -> how many of the class's waiters are the owner's
    owners: dict[tuple[str, str], int] = field(default_factory=dict)

    def waiting(self) -> int:
        """How many wait."""
        return sum(len(q) for q in self.queues.values())

    def waiters(self) -> list[Waiter]:
        """Every waiter, class by class."""
        return [w for q in self.queues.values() for w in q]

    def forget_owner(self, slot: tuple[str, str]) -> None:
        """One waiter of this owner and class fewer."""
        left = self.owners.get(slot, 1) - 1
        if left > 0:
            self.owners[slot] = left
        else:
            self.owners.pop(slot, None)

    def remove(self, waiter: Waiter) -> None:
        """Take a waiter out of its queue."""
        queue = self.queues.get(waiter.priority.name)
        if queue is not None and waiter in queue:
            queue.remove(waiter)

    def ahead_of(self, waiter: Waiter, now: float, aging: float) -> int:
        """How many waiters rank before `waiter` (binary search in each class)."""
        mine = waiter.rank(now, aging)
        ahead = 0
        for queue in self.queues.values():
            ahead += bisect.bisect_left(queue, mine, key=lambda w: w.rank(now, aging))
        return ahead

    def service_rate(self, now: float) -> float | None:
        """Requests finished per second over RATE_WINDOW, if measurable."""
        while self.finished and self.finished[0] < now - RATE_WINDOW:
            self.finished.popleft()
        if len(self.finished) < 2:
            return None
        span = max(now - self.finished[0], 1.0)
        return len(self.finished) / span

    def estimate(self, ahead: int, now: float, fallback: float) -> float:
        """Seconds a request behind `ahead` waiters would wait."""
        if not ahead and self.busy < self.capacity:
            return 0.0
        rate = self.service_rate(now)
        return fallback if rate is None else (ahead + 1) / rate


class Admission:
    """The priority queues of one event loop's gateway: one lane per deployment and
    context pool (named `deployment|pool`)."""

    def __init__(self) -> None:
        self.lanes: dict[str, Lane] = {}
        # The lanes of each deployment (`deployment|pool`): the load watcher asks for every
        # deployment's figures every second, which over all lanes each time grew with the
        # square of the fleet (bench/fleet_scale.py's idle gateway).
        self.by_deployment: dict[str, dict[str, Lane]] = {}
        self.counter = itertools.count()

    def lane(self, name: str) -> Lane:
        """The lane named `name`, made on first use."""
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = Lane()
            self.by_deployment.setdefault(name.split("|", 1)[0], {})[name] = lane
        return lane

    def queued(self, deployment: str) -> dict[str, int]:
        """Requests waiting, per class, over the deployment's lanes (for the metrics)."""
        out: dict[str, int] = {}
        for lane in self.by_deployment.get(deployment, {}).values():
            for cls, queue in lane.queues.items():
                if queue:
                    out[cls] = out.get(cls, 0) + len(queue)
        return out

    def estimated_wait(self, deployment: str) -> float:
        """Seconds a request joining the back of the deployment's longest queue would
        wait, from the measured service rate (0 with nobody waiting)."""
        now = time.monotonic()
        waits = []
        for lane in self.by_deployment.get(deployment, {}).values():
            count = lane.waiting()
            if count:
                fallback = max(w.priority.max_wait_seconds for w in lane.waiters())
                waits.append(lane.estimate(count, now, fallback))
        return max(waits, default=0.0)

    def deployments_waiting(self) -> set[str]:
        """The deployments with a request waiting in any of their lanes."""
        return {deployment for deployment, lanes in self.by_deployment.items()
                if any(lane.queues and lane.waiting() for lane in lanes.values())}

    def set_capacity(self, name: str, capacity: int) -> None:
        """The lane's slots changed: waiters take the new ones."""
        lane = self.lane(name)
        if lane.capacity != capacity:
            lane.capacity = capacity
            self.dispatch(lane)

    def try_acquire(self, name: str, capacity: int, priority: PriorityClass
                    ) -> Ticket | None:
        """A slot at once if one is free for this class and nobody waits (the common
        case: no task, no await), else None."""
        self.set_capacity(name, capacity)
        lane = self.lane(name)
        if lane.busy < priority.slots(lane.capacity) and not lane.waiting():
            lane.busy += 1
            return Ticket(name, 0, 0.0)
        return None

    async def acquire(self, name: str, capacity: int, priority: PriorityClass,
                      owner: str | None = None) -> Ticket:
        """A slot in the lane `name` (deployment|pool), at once or after waiting; raises
        Refused when the class's queue is full, the owner holds its share of it, or the
        wait runs out."""
        ticket = self.try_acquire(name, capacity, priority)
        if ticket is not None:
            return ticket
        lane = self.lane(name)
        now = time.monotonic()
        queue = lane.queues.setdefault(priority.name, deque())
        refuse_if_full(lane, priority, owner, now)
        waiter = Waiter(priority, now, next(self.counter),
                        asyncio.get_running_loop().create_future(), owner)
        aging = float(hot.GATEWAY_QUEUE_AGING_SECONDS)
        position = 1 + lane.ahead_of(waiter, now, aging)
        estimated = lane.estimate(position - 1, now, priority.max_wait_seconds)
        queue.append(waiter)
        gauge = queued_gauge(name, priority.name)
        gauge.inc()
        waiter.future.add_done_callback(lambda _: gauge.dec())
        if owner is not None:
            slot = (owner, priority.name)
            lane.owners[slot] = lane.owners.get(slot, 0) + 1
            waiter.future.add_done_callback(lambda _: lane.forget_owner(slot))
        self.dispatch(lane)
        if waiter.future.done():  # a free slot its class may use: no wait after all
            return Ticket(name, 0, 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future),
                                   timeout=priority.max_wait_seconds)
        except TimeoutError:
            if waiter.future.done():  # let through at the very moment the wait ran out
                return Ticket(name, position, estimated, time.monotonic() - now)
            lane.remove(waiter)
            waiter.future.cancel()
            retry = lane.estimate(lane.waiting(), time.monotonic(),
                                  priority.max_wait_seconds)
            raise Refused(503, f"waited {priority.max_wait_seconds:g} s in the "
                               f"{priority.name} queue without a free replica", retry,
                          "queue_timeout") from None
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.future.done():
                self.release(name, finished=False)
            else:
                lane.remove(waiter)
                waiter.future.cancel()
            raise
        return Ticket(name, position, estimated, time.monotonic() - now)

    def release(self, name: str, *, finished: bool = True) -> None:
        """Give a slot back (`finished`: a request served, for the service rate)."""
        lane = self.lane(name)
        lane.busy = max(0, lane.busy - 1)
        if finished:
            now = time.monotonic()
            lane.finished.append(now)
            # Trimmed here too, not only when an estimate is asked for: a lane that never
            # queues is never asked, and would keep every request's time for ever.
            while lane.finished[0] < now - RATE_WINDOW:
                lane.finished.popleft()
        self.dispatch(lane)

    def dispatch(self, lane: Lane) -> None:
        """Let the best-ranked waiters take the free slots their classes may use: compare
        the head of each class's queue, never the whole queue."""
        now = time.monotonic()
        aging = float(hot.GATEWAY_QUEUE_AGING_SECONDS)
        while lane.busy < lane.capacity:
            heads = []
            for queue in lane.queues.values():
                while queue and queue[0].future.done():  # cancelled meanwhile
                    queue.popleft()
                if queue and lane.busy < queue[0].priority.slots(lane.capacity):
                    heads.append(queue[0])
            if not heads:
                return
            best = min(heads, key=lambda w: w.rank(now, aging))
            lane.queues[best.priority.name].popleft()
            lane.busy += 1
            best.future.set_result(None)


def refuse_if_full(lane: Lane, priority: PriorityClass, owner: str | None,
                   now: float) -> None:
    """Raise Refused when the class's queue is full, or the owner holds its share of it."""
    queue = lane.queues.get(priority.name) or ()
    if len(queue) >= priority.max_queued:
        retry = lane.estimate(lane.waiting(), now, priority.max_wait_seconds)
        raise Refused(429, f"the {priority.name} queue of this deployment is full "
                           f"({priority.max_queued} waiting)", retry, "queue_full")
    if owner is not None:
        share = max(1, math.floor(priority.max_queued
                                  * float(settings.GATEWAY_KEY_QUEUE_SHARE)))
        mine = lane.owners.get((owner, priority.name), 0)
        if mine >= share:
            retry = lane.estimate(lane.waiting(), now, priority.max_wait_seconds)
            raise Refused(429, f"this caller already has {mine} requests waiting in the "
                               f"{priority.name} queue of this deployment (its share is "
                               f"{share})", retry, "key_queue_full")


def queued_gauge(lane: str, priority: str) -> Any:
    """The gauge of requests waiting in a lane, for one class."""
    from serving import metrics

    return metrics.child(metrics.QUEUED, lane.split("|", 1)[0], priority)


def retry_after_header(seconds: float) -> tuple[bytes, bytes]:
    """A Retry-After header of whole seconds (1 to 3600)."""
    return (b"retry-after", str(min(3600, max(1, math.ceil(seconds)))).encode())
