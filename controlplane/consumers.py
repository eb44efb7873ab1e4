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
import contextlib
import logging
import time
import uuid
from typing import Any

import orjson
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from access.roles import has_role
from controlplane import collector as collector_module
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
    """/ws/dashboard/ (the fleet) and /ws/dashboard/<deployment>/: what the collector
    pushes each interval, after what it holds already (the last 15 minutes)."""

    async def opened(self) -> None:
        self.deployment = self.scope["url_route"]["kwargs"].get("deployment")
        store = collector_module.current()
        if self.deployment is None:
            self.group = collector_module.FLEET_GROUP
            await self.channel_layer.group_add(self.group, self.channel_name)
            if store is not None:
                await self.send_json(store.store.fleet)
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


class PlaygroundError(Exception):
    pass


def number(message: dict[str, Any], name: str, low: float, high: float,
           default: float | None) -> float | None:
    value = message.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            low <= value <= high):
        raise PlaygroundError(f"`{name}` must be a number from {low:g} to {high:g}")
    return value


def chat_messages(message: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation to send: the system prompt first, then the turns, ending with the
    user's."""
    turns = message.get("messages")
    if not isinstance(turns, list) or not turns:
        raise PlaygroundError("`messages` must be a non-empty list of {role, content}")
    out: list[dict[str, str]] = []
    system = message.get("system") or ""
    if not isinstance(system, str):
        raise PlaygroundError("`system` must be a string")
    if system.strip():
        out.append({"role": "system", "content": system})
    for turn in turns:
        if (not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant")
                or not isinstance(turn.get("content"), str)):
            raise PlaygroundError("each message is {role: user|assistant, content: text}")
        out.append({"role": turn["role"], "content": turn["content"]})
    if out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise PlaygroundError("the prompt is empty: the last message must be the user's, "
                              "with some text")
    size = sum(len(m["content"]) for m in out)
    limit = settings.PLAYGROUND_MAX_PROMPT_CHARS
    if size > limit:
        raise PlaygroundError(f"the prompt is {size} characters, over the limit of {limit}")
    return out


class PlaygroundConsumer(GuardedConsumer):
    """/ws/playground/: chat completions streamed token by token, through the gateway's own
    routing and accounting code, in this process, as the logged-in user.

    In:  {"type": "generate", "id", "deployment", "system", "messages", "temperature",
          "top_p", "max_tokens", "seed"} and {"type": "stop", "id"}
    Out: "started", "token" (text), "done" (stats), "stopped", "error"
    """

    role = "operator"  # it runs inference on the fleet

    async def opened(self) -> None:
        self.running: dict[str, asyncio.Task[None]] = {}
        self.username = self.scope["user"].get_username()

    async def handle(self, message: dict[str, Any]) -> None:
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
        try:
            request = self.prepare(message)
        except PlaygroundError as exc:
            await self.error(str(exc), id=ident)
            return
        task = self.spawn(self.generate(ident, *request))
        self.running[ident] = task
        task.add_done_callback(lambda _: self.running.pop(ident, None))

    def prepare(self, message: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        from serving.routes import routes

        name = message.get("deployment")
        if not isinstance(name, str) or not name:
            raise PlaygroundError("`deployment` is required")
        pool = next((p for p in routes.table.pools.values() if p.deployment == name), None)
        if pool is None:
            raise PlaygroundError(f"no deployment named {name!r} is serving")
        top = min(settings.PLAYGROUND_MAX_TOKENS, pool.max_model_len or 10**9)
        max_tokens = number(message, "max_tokens", 1, top, min(256, top))
        body: dict[str, Any] = {
            "model": pool.served_model_name, "messages": chat_messages(message),
            "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": int(max_tokens or 1),
            "temperature": number(message, "temperature", 0, 2, 0.7),
            "top_p": number(message, "top_p", 0.01, 1, 1.0),
        }
        seed = message.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or not (
                    0 <= seed < 2**63):
                raise PlaygroundError("`seed` must be a whole number from 0, or empty")
            body["seed"] = seed
        return pool, body

    async def generate(self, ident: str, pool: Any, body: dict[str, Any]) -> None:
        from serving import metrics
        from serving.calls import GatewayError, estimate_prompt_tokens, prompt_prefix
        from serving.gateway import Timing, gateway
        from serving.upstream import UpstreamError

        timing = Timing()
        request_id = uuid.uuid4().hex
        model = pool.deployment
        raw = orjson.dumps(body)
        usage: dict[str, Any] | None = None
        status, replica_name, finish = 499, "", None
        response = None
        state = None
        try:
            replica, response = await gateway.open_upstream(
                pool, model, "/v1/chat/completions", raw, self.username,
                prompt_prefix(body, "chat"), request_id, timing, key=None, stream=True,
                user=self.username, prompt_tokens=estimate_prompt_tokens(body, "chat"))
            replica_name = replica.name
            state = gateway.router.state(replica.name)
            metrics.child(metrics.IN_FLIGHT, model, pool.deployment).inc()
            status = response.status
            await self.send_json({"type": "started", "id": ident, "deployment": pool.deployment,
                                  "replica": replica.name, "request_id": request_id})
            if status != 200:
                text = await response.read()
                try:
                    detail = orjson.loads(text)["error"]["message"]
                except Exception:
                    detail = text[:500].decode("utf-8", "replace")
                await self.error(f"the engine refused the request (HTTP {status}): {detail}",
                                 id=ident)
                return
            usage, finish = await self.relay(ident, response, timing)
            gateway.router.succeeded(replica.name)
            first = timing.first_byte - timing.arrived if timing.first_byte else None
            end = timing.last_chunk or time.perf_counter()
            completion = (usage or {}).get("completion_tokens")
            decode_seconds = end - timing.first_byte if timing.first_byte else 0
            await self.send_json({"type": "done", "id": ident, "stats": {
                "ttft_ms": round(first * 1000, 1) if first is not None else None,
                "e2e_ms": round((end - timing.arrived) * 1000, 1),
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "completion_tokens": completion,
                "tokens_per_s": round((completion - 1) / decode_seconds, 1)
                if completion and completion > 1 and decode_seconds > 0 else None,
                "finish_reason": finish}})
        except GatewayError as exc:
            status = exc.status
            await self.error(exc.message, id=ident)
        except UpstreamError as exc:
            status = 502
            gateway.router.failed(replica_name)
            await self.error(f"the replica failed mid-answer ({exc})", id=ident)
        except orjson.JSONDecodeError as exc:
            status = 502
            await self.error(f"the engine sent an event that is not JSON ({exc})", id=ident)
        except asyncio.CancelledError:
            status = 499
            if response is not None:
                response.close()  # the engine sees the connection go and stops
            with contextlib.suppress(Exception):
                await self.send_json({"type": "stopped", "id": ident})
            raise
        finally:
            if response is not None:
                response.release()
            if state is not None:
                state.in_flight -= 1
                metrics.child(metrics.IN_FLIGHT, model, pool.deployment).dec()
            gateway.release(timing)  # the admission slot (serving/admission.py)
            if replica_name:  # open_upstream recorded the requests it could not place
                gateway.record(None, model, pool, replica_name, status, True, usage, timing,
                               request_id, user=self.username)

    async def relay(self, ident: str, response: Any, timing: Any
                    ) -> tuple[dict[str, Any] | None, str | None]:
        """Turn the engine's SSE events into token messages, one per arriving piece."""
        pending = b""
        usage: dict[str, Any] | None = None
        finish: str | None = None
        while chunk := await response.readany():
            now = time.perf_counter()
            data = pending + chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                pending = data
                continue
            complete, pending = data[:cut], data[cut + 2:]
            text = []
            for event in complete.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                parsed = orjson.loads(event[6:])
                if parsed.get("usage"):
                    usage = parsed["usage"]
                for choice in parsed.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
            if text:
                if not timing.first_byte:
                    timing.first_byte = now
                else:
                    timing.gaps += now - timing.last_chunk
                timing.last_chunk = now
                timing.chunks += 1
                await self.send_json({"type": "token", "id": ident, "text": "".join(text)})
        return usage, finish
