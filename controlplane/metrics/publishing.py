"""The dashboards' Channels groups: one for the fleet and one per deployment, each sent
one message per pass, serialised once (the schema: docs/dashboards.md).

A deployment's group is sent its update only while a socket is in it (`watched`).
The fleet group gets what changed, not the fleet: its view is the FLEET_ROWS deployments
under the most load (and the totals of all of them). A socket that connects is sent the
view whole (`fleet`, `snapshot_text`); each pass then sends `fleet.delta`: the rows of the
view whose figures changed or that entered it, the names that left it, and the totals,
numbered by `seq`. Every SNAPSHOT_EVERY passes the whole view is sent again, to mend a
socket that missed a message. With Redis the whole view is also kept there
(SNAPSHOT_KEY), so that a socket served by a process that holds no collector starts from
it at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from channels.layers import InMemoryChannelLayer

logger = logging.getLogger(__name__)

FLEET_GROUP = "dashboard.fleet"
FLEET_ROWS = 50  # deployments in the fleet view: the ones under the most load
SNAPSHOT_EVERY = 15  # passes between two whole views sent to the group
_failing = [False]  # the last publication failed

# Summed over every deployment (not only the view's) into the messages' `totals`.
TOTALLED = ("ready", "desired", "standby", "requests_per_s", "tokens_per_s", "waiting",
            "running", "in_flight", "queued", "scrape_failures")


def deployment_group(name: str) -> str:
    """The Channels group of one deployment's dashboards."""
    return f"dashboard.deployment.{name}"


def load_order(summary: dict[str, Any]) -> tuple[float, float, float, str]:
    """Most load first: requests/s, then tokens/s, then requests in the engines; then by
    name (static/js/dashboard_fleet.js sorts the same way)."""
    return (-(summary.get("requests_per_s") or 0.0), -(summary.get("tokens_per_s") or 0.0),
            -((summary.get("waiting") or 0.0) + (summary.get("running") or 0.0)),
            summary["name"])


def totals(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {"deployments": len(summaries)}
    for field in TOTALLED:
        found[field] = round(sum(s.get(field) or 0 for s in summaries), 3)
    return found


class FleetView:
    """The last view sent to the fleet group, to tell the next pass's changes from."""

    def __init__(self, rows: int = FLEET_ROWS) -> None:
        self.size = rows
        self.rows: dict[str, dict[str, Any]] = {}
        self.seq = 0
        self.snapshot_text: str | None = None  # the whole view, for sockets that connect

    def next_message(self, fleet: dict[str, Any]) -> dict[str, Any]:
        """This pass's message for the group (a delta, or every SNAPSHOT_EVERY passes the
        whole view); `snapshot_text` is brought up to date either way."""
        summaries = list(fleet.get("deployments") or [])
        view = sorted(summaries, key=load_order)[:self.size]
        rows = {s["name"]: s for s in view}
        self.seq += 1
        head = {"t": fleet.get("t"), "seq": self.seq, "rows": self.size,
                "total": len(summaries), "totals": totals(summaries)}
        snapshot = {"type": "fleet", **head, "deployments": view}
        self.snapshot_text = orjson.dumps(snapshot).decode()
        delta = {"type": "fleet.delta", **head,
                 "changed": [s for s in view if self.rows.get(s["name"]) != s],
                 "removed": sorted(set(self.rows) - set(rows))}
        self.rows = rows
        return snapshot if self.seq % SNAPSHOT_EVERY == 1 else delta


fleet_view = FleetView()


SNAPSHOT_KEY = "fleetplane:dashboard:fleet"  # the whole view, for processes without a collector
SNAPSHOT_TTL_SECONDS = 60


def snapshot_text() -> str | None:
    """The whole fleet view of the last pass in this process (None: no collector here)."""
    return fleet_view.snapshot_text


def shared_snapshot_text(redis_url: str | None) -> str | None:
    """The whole fleet view the collector last left in Redis, for a socket served by a
    process that holds no collector (scale-out); None without Redis, when the collector
    has not written one within SNAPSHOT_TTL_SECONDS, or when Redis does not answer (the
    socket then starts from the next whole view the group is sent)."""
    if not redis_url:
        return None
    from serving.redis_clients import shared

    try:
        found = shared(redis_url).get(SNAPSHOT_KEY)
    except Exception as error:
        logger.info("no shared fleet view (%s)", error)
        return None
    return found.decode() if isinstance(found, bytes) else found


def _share_snapshot(redis_url: str, text: str) -> None:
    from serving.redis_clients import shared

    shared(redis_url).set(SNAPSHOT_KEY, text, ex=SNAPSHOT_TTL_SECONDS)


# Which of KEYS exist, in one command: a pipeline of a thousand EXISTS costs about five
# times this one call in redis-py's packing (bench/probe_calls.py).
_EXISTING = ("local found = {} for i, key in ipairs(KEYS) do "
             "found[i] = redis.call('EXISTS', key) end return found")


async def watched(layer: Any, groups: list[str]) -> list[str]:
    """The groups with a socket in them, of `groups`: a fleet of a thousand deployments
    has a dashboard open on a few, and sending to an empty group costs the Redis layer two
    round trips (its expiry sweep and its member list), 2,000 every pass. One look-up per
    Redis host here (a group the layer keeps is a key; an empty one is no key); a group
    whose socket went without leaving it (a process killed) still counts until the
    layer's own group expiry. Every group for a layer of another kind."""
    if isinstance(layer, InMemoryChannelLayer):
        return [group for group in groups if layer.groups.get(group)]
    key_of = getattr(layer, "_group_key", None)
    if key_of is None or not hasattr(layer, "consistent_hash"):
        return groups
    by_host: dict[int, list[str]] = {}
    for group in groups:
        by_host.setdefault(layer.consistent_hash(group), []).append(group)
    found: list[str] = []
    for index, members in by_host.items():
        if not members:
            continue
        counts = await layer.connection(index).eval(
            _EXISTING, len(members), *(key_of(group) for group in members))
        found.extend(g for g, count in zip(members, counts, strict=True) if count)
    return found


async def publish(fleet: dict[str, Any], updates: dict[str, dict[str, Any]]) -> None:
    """Send the fleet's changes and each deployment's update to their groups; a failure
    is logged, never raised (the next pass sends again)."""
    from channels.layers import get_channel_layer
    from django.conf import settings

    message = fleet_view.next_message(fleet)
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        if settings.REDIS_URL and fleet_view.snapshot_text is not None:
            await asyncio.to_thread(_share_snapshot, settings.REDIS_URL,
                                    fleet_view.snapshot_text)
        # Serialised once here, not once per socket.
        await layer.group_send(FLEET_GROUP, {"type": "dashboard.message",
                                             "text": orjson.dumps(message).decode()})
        groups = {deployment_group(name): update for name, update in updates.items()}
        for group in await watched(layer, list(groups)):
            await layer.group_send(group, {"type": "dashboard.message",
                                           "text": orjson.dumps(groups[group]).decode()})
    except Exception as error:
        # Once per outage of the channel layer (Redis), not a traceback every pass.
        if not _failing[0]:
            logger.warning("publishing dashboard updates failed (%s); the dashboards get "
                           "no updates until it works again", error, exc_info=True)
        _failing[0] = True
        return
    if _failing[0]:
        logger.warning("dashboard updates are published again")
    _failing[0] = False
