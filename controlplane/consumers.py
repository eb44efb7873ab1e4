"""WebSocket consumers under /ws/: the live dashboards and the playground.

Rules every socket follows: only logged-in users who may see deployments connect; a frame
over WEBSOCKET_MAX_MESSAGE_BYTES, a frame that is not a JSON object, an unknown message type
or more than WEBSOCKET_MESSAGES_PER_SECOND frames get an error message back and the socket
stays open; every task a consumer starts is cancelled when the socket closes. A user who
loses the role a socket needs (demoted, deactivated, deleted) has it closed with code
4403, what it was running stopped (controlplane/revocation.py). Message schemas:
docs/dashboards.md and docs/playground.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from access.roles import has_role
from controlplane import collector as collector_module
from controlplane.metrics import publishing
from controlplane.revocation import user_group

logger = logging.getLogger(__name__)

MAX_GENERATIONS = 2  # the playground's side-by-side mode runs two at once


class GuardedConsumer(AsyncWebsocketConsumer):
    """Authentication, the role (controlplane/roles.py), limits and task bookkeeping
    shared by every socket."""

    role = "viewer"

    async def connect(self) -> None:
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(has_role)(user, self.role):
            await self.close(code=4403)
            return
        self.tasks: set[asyncio.Task[None]] = set()
        rate = float(settings.WEBSOCKET_MESSAGES_PER_SECOND)
        self.burst = max(1.0, 2 * rate)
        self.allowance = self.burst
        self.checked = time.monotonic()
        self.user_id = user.pk
        await self.channel_layer.group_add(user_group(user.pk), self.channel_name)
        await self.accept()
        self.spawn(self.recheck_access())
        await self.opened()

    async def access_changed(self, event: dict[str, Any]) -> None:
        """The user was changed somewhere: still allowed?"""
        await self.check_access()

    async def recheck_access(self) -> None:
        """Without a shared channel layer a change made in another process is not told:
        look again every KEY_CACHE_SECONDS. A failed look (the database away for a moment)
        is logged and tried again next time: one error must not end the checks for good."""
        while True:
            await asyncio.sleep(max(1.0, float(settings.KEY_CACHE_SECONDS)))
            try:
                await self.check_access()
            except Exception:
                logger.exception("could not re-check the access of user %s", self.user_id)

    async def check_access(self) -> None:
        if await database_sync_to_async(still_allowed)(self.user_id, self.role):
            return
        tasks = [t for t in self.tasks if t is not asyncio.current_task()]
        for task in tasks:  # what it runs ends with it, whatever the client does next
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.close(code=4403)

    async def opened(self) -> None:
        """Called once the socket is accepted."""

    async def handle(self, message: dict[str, Any]) -> None:
        """A message other than ping; a socket that only listens refuses every one."""
        await self.error(f"unknown message type {message['type']!r}: this socket only "
                         f"listens (and answers ping)")

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(text_data=orjson.dumps(message).decode())

    async def error(self, text: str, **extra: Any) -> None:
        await self.send_json({"type": "error", "message": text, **extra})

    def over_rate(self) -> bool:
        rate = float(settings.WEBSOCKET_MESSAGES_PER_SECOND)
        now = time.monotonic()
        self.allowance = min(self.burst, self.allowance + (now - self.checked) * rate)
        self.checked = now
        if self.allowance < 1:
            return True
        self.allowance -= 1
        return False

    async def receive(self, text_data: str | None = None,
                      bytes_data: bytes | None = None) -> None:
        limit = settings.WEBSOCKET_MAX_MESSAGE_BYTES
        if text_data is None:
            await self.error("send text frames holding a JSON object, not binary frames")
            return
        # surrogatepass: a str holding lone surrogates is measured, then refused as not JSON.
        if len(text_data) > limit or len(text_data.encode("utf-8", "surrogatepass")) > limit:
            await self.error(f"message over the limit of {limit} bytes")
            return
        if self.over_rate():
            await self.error(f"too many messages: at most "
                             f"{settings.WEBSOCKET_MESSAGES_PER_SECOND:g} per second")
            return
        try:
            message = orjson.loads(text_data)
        except orjson.JSONDecodeError as exc:
            await self.error(f"not JSON: {exc}")
            return
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            await self.error('a message is a JSON object with a "type"')
            return
        if message["type"] == "ping":
            await self.send_json({"type": "pong"})
            return
        await self.handle(message)

    def spawn(self, work: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def disconnect(self, code: int) -> None:
        if getattr(self, "user_id", None) is not None:
            await self.channel_layer.group_discard(user_group(self.user_id), self.channel_name)
        tasks = list(getattr(self, "tasks", ()))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def still_allowed(user_id: int, role: str) -> bool:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.filter(pk=user_id).first()
    return user is not None and has_role(user, role)


# --- dashboards -----------------------------------------------------------------------


def deployment_exists(name: str) -> bool:
    from controlplane.models import Deployment

    return Deployment.objects.filter(name=name, deleting=False).exists()


class DashboardConsumer(GuardedConsumer):
    """/ws/dashboard/ (the fleet: its busiest deployments whole, then what changed) and
    /ws/dashboard/<deployment>/ (what the collector holds already, the last 15 minutes,
    then each pass's update)."""

    async def opened(self) -> None:
        self.deployment = self.scope["url_route"]["kwargs"].get("deployment")
        store = collector_module.current()
        if self.deployment is None:
            self.group = collector_module.FLEET_GROUP
            await self.channel_layer.group_add(self.group, self.channel_name)
            # The whole view once; the group's messages after it carry what changed.
            if store is not None:
                snapshot = publishing.snapshot_text()
            else:  # scale-out: the view the collector left in Redis, if any
                snapshot = await asyncio.to_thread(publishing.shared_snapshot_text,
                                                   settings.REDIS_URL)
            if snapshot is not None:
                await self.send(text_data=snapshot)
            return
        if not await database_sync_to_async(deployment_exists)(self.deployment):
            await self.error(f"no deployment named {self.deployment!r}", code="not_found")
            await self.close(code=4404)
            return
        self.group = collector_module.deployment_group(self.deployment)
        await self.channel_layer.group_add(self.group, self.channel_name)
        history = (store.store.deployment_history(self.deployment) if store is not None
                   else {"type": "history", "deployment": self.deployment, "replicas": {},
                         "gateway": []})
        await self.send_json(history)

    async def disconnect(self, code: int) -> None:
        group = getattr(self, "group", None)
        if group:
            await self.channel_layer.group_discard(group, self.channel_name)
        await super().disconnect(code)

    async def dashboard_message(self, event: dict[str, Any]) -> None:
        await self.send(text_data=event["text"])


# --- playground -----------------------------------------------------------------------


class PlaygroundConsumer(GuardedConsumer):
    """/ws/playground/: chat completions streamed token by token, generated by the data
    plane in this process (serving/playground.py), as the logged-in user. This socket
    keeps its protocol: ids, stop, and at most MAX_GENERATIONS at once.

    In:  {"type": "generate", "id", "deployment", "system", "messages", "temperature",
          "top_p", "max_tokens", "seed"} and {"type": "stop", "id"}
    Out: "started", "token" (text), "done" (stats), "stopped", "error"
    """

    role = "operator"  # it runs inference on the fleet

    async def opened(self) -> None:
        """Nothing runs yet."""
        self.running: dict[str, asyncio.Task[None]] = {}
        self.username = self.scope["user"].get_username()

    async def handle(self, message: dict[str, Any]) -> None:
        """Start a generation (`generate`) or stop one (`stop`)."""
        kind = message["type"]
        ident = message.get("id", "main")
        if not isinstance(ident, str) or not 0 < len(ident) <= 64:
            await self.error("`id` must be a short string")
            return
        if kind == "stop":
            task = self.running.get(ident)
            if task is None:
                await self.error(f"nothing is running under id {ident!r}", id=ident)
            else:
                task.cancel()
            return
        if kind != "generate":
            await self.error(f"unknown message type {kind!r}: use generate or stop", id=ident)
            return
        if ident in self.running:
            await self.error(f"{ident!r} is still generating: stop it first", id=ident)
            return
        if len(self.running) >= MAX_GENERATIONS:
            await self.error(f"at most {MAX_GENERATIONS} generations at once", id=ident)
            return
        from serving import playground

        try:
            generation = playground.prepare(message)
        except playground.PlaygroundError as exc:
            await self.error(str(exc), id=ident)
            return
        task = self.spawn(playground.generate(ident, generation, self.username,
                                              self.send_json))
        self.running[ident] = task
        task.add_done_callback(lambda _: self.running.pop(ident, None))
