"""Requests waiting at the gateway for a deployment that has no ready replica (scaled to
zero): the autoscaler's signal to bring one up, and the wait itself. The count is also
exported as the gauge `fleetplane_gateway_cold_start_waiting_requests{deployment}`, which
KEDA reads to wake a deployment it scaled to zero.

Counts are kept per process; with REDIS_URL set each waiting gateway process also writes
its count to Redis under `fleetplane:demand:<deployment>:<process>` with a short expiry,
refreshed while it waits, so the controller sees demand from every gateway process.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

from serving.metrics import COLD_START_WAITING, child
from serving.wakeup import Wakeup

logger = logging.getLogger(__name__)

REDIS_PREFIX = "fleetplane:demand:"
REDIS_TTL_SECONDS = 5
PROCESS = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Demand:
    """Requests waiting in this process for a deployment to come up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, int] = {}
        #: Set when a request starts waiting: an autoscaler in this process decides at once.
        self.arrived = Wakeup()

    def add(self, deployment: str, count: int) -> int:
        """Count requests starting (+) or ending (-) a wait; returns the count."""
        if count > 0:
            self.arrived.set()
        with self._lock:
            value = max(0, self._waiting.get(deployment, 0) + count)
            if value:
                self._waiting[deployment] = value
            else:
                self._waiting.pop(deployment, None)
            # Inside the lock: the gauge never shows an older count than the last add.
            child(COLD_START_WAITING, deployment).set(value)
            return value

    def waiting(self, deployment: str) -> int:
        """How many wait for the deployment here."""
        with self._lock:
            return self._waiting.get(deployment, 0)

    async def publish(self, connection: Any, deployment: str) -> None:
        """Tell the controller (through Redis) how many requests wait here."""
        key = f"{REDIS_PREFIX}{deployment}:{PROCESS}"
        count = self.waiting(deployment)
        try:
            if count:
                await connection.set(key, count, ex=REDIS_TTL_SECONDS)
            else:
                await connection.delete(key)
        except Exception:  # the wait goes on; the in-process count still counts
            logger.warning("could not publish demand for %s to Redis", deployment)


def total(deployment: str, redis_url: str | None) -> int:
    """Requests waiting for this deployment: here, and in other processes (Redis)."""
    count = demand.waiting(deployment)
    if not redis_url:
        return count
    try:
        from serving.redis_clients import shared

        connection = shared(redis_url)
        for key in connection.scan_iter(match=f"{REDIS_PREFIX}{deployment}:*", count=100):
            if key.decode().rsplit(":", 1)[-1] == PROCESS:
                continue  # this process's own, counted above
            value = connection.get(key)
            count += int(value or 0)
    except Exception:
        logger.warning("could not read demand for %s from Redis", deployment)
    return count


demand = Demand()
