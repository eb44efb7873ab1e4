"""One request to the data plane, built once and handed to every stage: who asks (a key,
or a playground user), which deployment's routes it goes to, the body to send, its ids,
its estimates, its timings and the admission slot it holds.

`build_call` makes one from an HTTP request's body: the parameter checks, the model name
resolved to a deployment, the key's right to it, the priority class, the estimates, and
the body rewritten for the replica where it must be.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from serving.admission import Ticket
from serving.calls import (
    GatewayError,
    check_parameters,
    estimate_prompt_tokens,
    new_id,
    prompt_prefix,
    reserved_completion_tokens,
)
from serving.keys import KeyInfo
from serving.priority import DEFAULT_CLASS, PriorityClass, classes
from serving.ratelimit import Limit
from serving.routes import DeploymentRoutes, routes
from serving.upstream import Pipe

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# Writes one chunk of a streamed answer at once; False when it must be sent the ASGI way.
WriteBody = Callable[[bytes, bool], bool]
# The scope's extension where the server offers a WriteBody (controlplane/http_protocol.py,
# which names it alike).
WRITE_BODY = "fleetplane.write_body"
# Has a callback called if the client goes (None: no longer), where the server offers it.
WhenLost = Callable[[Callable[[], None] | None], None]
WHEN_LOST = "fleetplane.when_lost"
# Gives a Pipe (serving/upstream/pipe.py) the client's transport, where the server offers it.
PipeTo = Callable[[Pipe], None]
PIPE = "fleetplane.pipe"


@dataclass(eq=False, slots=True)
class Timing:
    """When things happened to one request (time.perf_counter), and what was relayed."""

    arrived: float = field(default_factory=time.perf_counter)
    sent: float = 0.0
    first_byte: float = 0.0
    last_chunk: float = 0.0
    gaps: float = 0.0
    chunks: int = 0
    events: int = 0  # SSE data events relayed (the completion's size when no usage came)


@dataclass(eq=False, slots=True)
class Call:
    """Everything known about one request, from its arrival to its usage record."""

    routes: DeploymentRoutes  # narrowed to one context pool once placed
    model: str  # the name the caller used (the metrics' label)
    path: str  # the replica's path, e.g. /v1/chat/completions
    raw: bytes  # the body the replica gets
    stream: bool
    request_id: str = field(default_factory=new_id)
    key: KeyInfo | None = None
    user: str = ""  # the playground's user, who has no key
    priority: PriorityClass | None = None  # None: the default class
    prompt_tokens: int = 0  # estimated from the body
    reserved: int = 0  # completion tokens charged to the token budget at admission
    affinity: str | None = None  # the session a `session` policy keeps on one replica
    prefix: str | None = None  # the prompt's start, for the `prefix` policy
    wants_usage: bool = False  # the client asked for the usage event of a stream
    # The stream's chunks carry the usage so far (read for the record), and whether the
    # client asked for it too (else it is taken out)
    running_usage: bool = False
    wants_running_usage: bool = False
    limits: list[Limit] = field(default_factory=list)  # rate limits charged at admission
    receive: Receive | None = None  # an HTTP client's messages: leaving the queue on going
    write_body: WriteBody | None = None  # the server's, for the chunks of a stream
    when_lost: WhenLost | None = None  # the server's, to hear of the client going at once
    pipe_to: PipeTo | None = None  # the server's, to pipe a stream's chunks as they come
    timing: Timing = field(default_factory=Timing)
    ticket: Ticket | None = None  # the admission slot held, given back when the call ends
    answered: bool = False  # a replica answered (else admission's charge is given back)
    client_left: bool = False  # the HTTP client went before its answer ended

    @property
    def deployment(self) -> str:
        """The deployment the call goes to."""
        return self.routes.deployment

    @property
    def owner(self) -> str:
        """Who holds the call's place in a queue: its key, or its user."""
        return f"key:{self.key.key_id}" if self.key is not None else f"user:{self.user}"

    def priority_class(self) -> PriorityClass:
        """The class the call is admitted in."""
        return self.priority or classes()[DEFAULT_CLASS]


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (latin-1), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
    return body


def routes_allowed(body: dict[str, Any], key: KeyInfo) -> DeploymentRoutes:
    """The routes of the model the body names, if the key may use it."""
    model = body["model"]
    found = routes.table.routes_for(model)
    if found is None:
        raise GatewayError(404, f"The model `{model}` does not exist.",
                           kind="not_found_error", param="model", code="model_not_found")
    if not key.allows(model, found.deployment, found.served_model_name):
        raise GatewayError(403, f"this API key may not use the model `{model}`",
                           kind="permission_error", param="model", code="model_not_allowed")
    return found


def priority_of(scope: Scope, key: KeyInfo) -> PriorityClass:
    """The key's class, or a lower one asked for with X-Priority."""
    known = classes()
    own = known.get(key.priority) or known[DEFAULT_CLASS]
    asked = header(scope, b"x-priority")
    if not asked:
        return own
    wanted = known.get(asked.strip().lower())
    if wanted is None:
        raise GatewayError(400, f"unknown priority class {asked.strip()[:40]!r}: one of "
                                f"{', '.join(known)}", param="x-priority",
                           code="invalid_priority")
    if wanted.level < own.level:
        raise GatewayError(403, f"this API key may not use the priority class "
                                f"{wanted.name!r} (its highest is {own.name!r})",
                           kind="permission_error", param="x-priority",
                           code="priority_not_allowed")
    return wanted


def for_replica(body: dict[str, Any], raw: bytes, found: DeploymentRoutes,
                priority: PriorityClass) -> bytes:
    """The body as the replica must get it: its served model name, the priority level when
    its engine schedules by it, and the usage of a stream (the records need it; it is
    taken out again unless the client asked): the final usage event always, and the usage
    so far on every chunk where the engine gives it (`running_usage`), so a stream the
    client leaves is recorded with what was relayed."""
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    wanted = {"include_usage": True, "continuous_usage_stats": True} if (
        found.running_usage) else {"include_usage": True}
    # Written out, not any() over a generator: this runs for every request.
    usage_missing = stream and (not options.get("include_usage") or (
        found.running_usage and not options.get("continuous_usage_stats")))
    rewrite = body["model"] != found.served_model_name or usage_missing
    if found.priority_scheduling:  # vLLM's scheduler orders by it (lower first)
        body["priority"] = priority.level
        rewrite = True
    if not rewrite:
        return raw
    body["model"] = found.served_model_name
    if usage_missing:
        body["stream_options"] = {**options, **wanted}
    return orjson.dumps(body)


def check_task(found: DeploymentRoutes, kind: str, model: str) -> None:
    """Refuse a request the model cannot answer: a chat or completion for an embedding
    model, embeddings from a model that generates text."""
    if found.task == "embed" and kind != "embedding":
        raise GatewayError(400, f"the model `{model}` is an embedding model: it answers "
                                f"/v1/embeddings only", param="model",
                           code="model_not_generative")
    if found.task != "embed" and kind == "embedding":
        raise GatewayError(400, f"the model `{model}` generates text: /v1/embeddings needs "
                                f"an embedding model", param="model",
                           code="model_not_embedding")


def build_call(scope: Scope, raw: bytes, kind: str, key: KeyInfo, request_id: str,
               timing: Timing) -> Call:
    """The call an HTTP request makes, checked: refusals raise GatewayError."""
    body = parse_body(raw)
    check_parameters(body, kind)
    model = body["model"]
    found = routes_allowed(body, key)
    check_task(found, kind, model)
    priority = priority_of(scope, key)
    prompt_tokens = estimate_prompt_tokens(body, kind)
    reserved = reserved_completion_tokens(body, kind, found.max_model_len, prompt_tokens)
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    wants_usage = bool(options.get("include_usage"))
    wants_running_usage = wants_usage and bool(options.get("continuous_usage_stats"))
    raw = for_replica(body, raw, found, priority)
    affinity = header(scope, b"x-session-id") or str(body.get("user") or "") or None
    return Call(routes=found, model=model, path=scope["path"], raw=raw, stream=stream,
                request_id=request_id, key=key, priority=priority,
                prompt_tokens=prompt_tokens, reserved=reserved, affinity=affinity,
                prefix=prompt_prefix(body, kind), wants_usage=wants_usage,
                running_usage=stream and found.running_usage,
                wants_running_usage=wants_running_usage, timing=timing)
