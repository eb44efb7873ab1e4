"""The dashboards' Channels groups: one for the fleet and one per deployment, each sent
one message per pass, serialised once (the schema: docs/dashboards.md)."""

from __future__ import annotations

import logging
from typing import Any

import orjson

logger = logging.getLogger(__name__)

FLEET_GROUP = "dashboard.fleet"
_failing = [False]  # the last publication failed


def deployment_group(name: str) -> str:
    """The Channels group of one deployment's dashboards."""
    return f"dashboard.deployment.{name}"


async def publish(fleet: dict[str, Any], updates: dict[str, dict[str, Any]]) -> None:
    """Send the fleet message and each deployment's update to their groups; a failure is
    logged, never raised (the next pass sends again)."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        # Serialised once here, not once per socket.
        await layer.group_send(FLEET_GROUP, {"type": "dashboard.message",
                                             "text": orjson.dumps(fleet).decode()})
        for name, update in updates.items():
            await layer.group_send(deployment_group(name),
                                   {"type": "dashboard.message",
                                    "text": orjson.dumps(update).decode()})
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
