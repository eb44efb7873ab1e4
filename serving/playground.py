"""The playground's generations: a chat completion streamed token by token to a socket,
through the data plane's one public API (`gateway.session`), as the logged-in user. It
is placed, queued (as a standard-class request), retried and accounted exactly as an HTTP
request is; its usage records carry the user's name instead of a key.

The socket's own protocol, roles and limits stay with the consumer
(controlplane/consumers.py), which hands each `generate` message here with a function
that sends a message back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings

from serving.calls import GatewayError, estimate_prompt_tokens, prompt_prefix
from serving.gateway import Call, Timing, gateway
from serving.routes import DeploymentRoutes, routes
from serving.session import Stream
from serving.upstream import UpstreamError

Emit = Callable[[dict[str, Any]], Awaitable[None]]


class PlaygroundError(Exception):
    """A generate message the playground refuses; the text says why."""


@dataclass(frozen=True)
class Generation:
    """A checked generate message: which deployment, and the chat body to send."""

    routes: DeploymentRoutes
    body: dict[str, Any]


def number(message: dict[str, Any], name: str, low: float, high: float,
           default: float | None) -> float | None:
    """A numeric field within [low, high], or its default."""
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


def prepare(message: dict[str, Any]) -> Generation:
    """A generate message checked against the deployments serving now."""
    name = message.get("deployment")
    if not isinstance(name, str) or not name:
        raise PlaygroundError("`deployment` is required")
    found = routes.table.deployment(name)
    if found is None:
        raise PlaygroundError(f"no deployment named {name!r} is serving")
    if found.task == "embed":
        raise PlaygroundError(f"{name!r} serves an embedding model: the playground chats "
                              f"with models that generate text")
    top = min(settings.PLAYGROUND_MAX_TOKENS, found.max_model_len or 10**9)
    max_tokens = number(message, "max_tokens", 1, top, min(256, top))
    body: dict[str, Any] = {
        "model": found.served_model_name, "messages": chat_messages(message),
        # The usage so far on every chunk where the engine gives it: a stopped generation
        # is recorded with what was streamed.
        "stream": True, "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": found.running_usage},
        "max_tokens": int(max_tokens or 1),
        "temperature": number(message, "temperature", 0, 2, 0.7),
        "top_p": number(message, "top_p", 0.01, 1, 1.0),
    }
    seed = message.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
            raise PlaygroundError("`seed` must be a whole number from 0, or empty")
        body["seed"] = seed
    return Generation(found, body)


def playground_call(generation: Generation, user: str) -> Call:
    """The call a generation makes, as `user` (standard class, no key)."""
    body = generation.body
    return Call(routes=generation.routes, model=generation.routes.deployment,
                path="/v1/chat/completions", raw=orjson.dumps(body), stream=True,
                user=user, prompt_tokens=estimate_prompt_tokens(body, "chat"),
                affinity=user, prefix=prompt_prefix(body, "chat"), timing=Timing())


async def generate(ident: str, generation: Generation, user: str, emit: Emit) -> None:
    """Run one generation, telling the socket through `emit`: started, token..., done, or
    an error; a cancelled generation says "stopped" (and the engine stops)."""
    call = playground_call(generation, user)
    try:
        async with gateway.session(call) as stream:
            await emit({"type": "started", "id": ident, "deployment": call.deployment,
                        "replica": stream.replica.name, "request_id": call.request_id})
            await answer(ident, call, stream, emit)
    except GatewayError as exc:
        await emit({"type": "error", "message": exc.message, "id": ident})
    except asyncio.CancelledError:  # stopped, or the socket closed: the engine stops too
        with contextlib.suppress(Exception):
            await emit({"type": "stopped", "id": ident})
        raise


async def answer(ident: str, call: Call, stream: Stream, emit: Emit) -> None:
    """The engine's answer to the socket: its tokens and stats, or why it failed."""
    if stream.status != 200:
        text = await stream.response.read()
        try:
            detail = orjson.loads(text)["error"]["message"]
        except Exception:
            detail = text[:500].decode("utf-8", "replace")
        stream.ended()
        await emit({"type": "error", "message": f"the engine refused the request "
                                                f"(HTTP {stream.status}): {detail}",
                    "id": ident})
        return
    try:
        usage, finish = await relay_tokens(ident, stream, call.timing, emit)
    except UpstreamError as exc:
        stream.status = 502
        stream.broke()
        await emit({"type": "error", "message": f"the replica failed mid-answer ({exc})",
                    "id": ident})
        return
    except orjson.JSONDecodeError as exc:
        stream.status = 502
        await emit({"type": "error",
                    "message": f"the engine sent an event that is not JSON ({exc})",
                    "id": ident})
        return
    stream.ended(usage)
    await emit({"type": "done", "id": ident, "stats": stats(call.timing, usage, finish)})


def stats(timing: Timing, usage: dict[str, Any] | None,
          finish: str | None) -> dict[str, Any]:
    """What the page shows when an answer is done."""
    first = timing.first_byte - timing.arrived if timing.first_byte else None
    end = timing.last_chunk or time.perf_counter()
    completion = (usage or {}).get("completion_tokens")
    decode_seconds = end - timing.first_byte if timing.first_byte else 0
    return {
        "ttft_ms": round(first * 1000, 1) if first is not None else None,
        "e2e_ms": round((end - timing.arrived) * 1000, 1),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "completion_tokens": completion,
        "tokens_per_s": round((completion - 1) / decode_seconds, 1)
        if completion and completion > 1 and decode_seconds > 0 else None,
        "finish_reason": finish}


async def relay_tokens(ident: str, stream: Stream, timing: Timing, emit: Emit
                       ) -> tuple[dict[str, Any] | None, str | None]:
    """Turn the engine's SSE events into token messages, one per arriving piece."""
    pending = b""
    usage: dict[str, Any] | None = None
    finish: str | None = None
    while chunk := await stream.response.readany():
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
                usage = stream.usage = parsed["usage"]  # kept should the caller stop
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
            await emit({"type": "token", "id": ident, "text": "".join(text)})
    return usage, finish
