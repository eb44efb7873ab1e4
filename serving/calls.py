"""A request to the gateway as a body: the checks a gateway can make cheaply (the engine
checks the rest), the estimates admission needs (prompt tokens, the completion tokens to
reserve, the prefix for affinity routing), whether an API key is well formed, and the
error every refusal is answered with, in OpenAI's shape."""

from __future__ import annotations

import itertools
import os
import re
from typing import Any

import orjson


class IdMaker:
    """Ids for requests and usage records: 32 hex digits, as uuid4's, unique across
    processes and restarts (16 random ones per process, drawn again in a forked child,
    then a counter), made without a system call or a UUID object each: a request takes
    two."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


new_id = IdMaker()


class GatewayError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or []

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}})


def _positive_int(body: dict[str, Any], name: str, maximum: int = 10_000_000) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise GatewayError(400, f"`{name}` must be a whole number from 1 to {maximum}",
                           param=name, code="invalid_value")


def check_parameters(body: dict[str, Any], kind: str) -> None:
    """The checks a gateway can make cheaply; the engine checks the rest."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "`model` is required and must be a string", param="model",
                           code="invalid_value")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError(400, "`messages` must be a non-empty list", param="messages",
                               code="invalid_value")
    elif kind == "completion":
        if not isinstance(body.get("prompt"), str | list):
            raise GatewayError(400, "`prompt` is required: a string or a list",
                               param="prompt", code="invalid_value")
    elif not isinstance(body.get("input"), str | list):
        raise GatewayError(400, "`input` is required: a string or a list", param="input",
                           code="invalid_value")
    elif not body["input"] or (isinstance(body["input"], list)
                               and any(item in ("", []) for item in body["input"])):
        raise GatewayError(400, "`input` must not be empty, nor hold an empty string or "
                                "list", param="input", code="invalid_value")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise GatewayError(400, "`stream` must be true or false", param="stream",
                           code="invalid_value")
    if body.get("stream_options") is not None:
        if not body.get("stream"):
            raise GatewayError(400, "`stream_options` is only allowed with `stream`: true",
                               param="stream_options", code="invalid_value")
        if not isinstance(body["stream_options"], dict):
            raise GatewayError(400, "`stream_options` must be an object",
                               param="stream_options", code="invalid_value")
    _positive_int(body, "max_tokens")
    _positive_int(body, "max_completion_tokens")
    _positive_int(body, "n", 128)
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(
            temperature, int | float) or not 0 <= temperature <= 2):
        raise GatewayError(400, "`temperature` must be a number from 0 to 2",
                           param="temperature", code="invalid_value")


def estimate_prompt_tokens(body: dict[str, Any], kind: str) -> int:
    """The prompt's size in tokens, estimated from its characters (about four per token
    for English text with the common tokenizers), for token budgets and context pools."""
    chars = 0
    if kind == "chat":
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part.get("text") or "") for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
            chars += 16  # the role and the chat template's markers
    else:
        value = body.get("prompt") if kind == "completion" else body.get("input")
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, list):  # token ids
                chars += 4 * len(item)
    return max(1, (chars + 3) // 4)


# A completion without max_tokens makes at most 16 tokens (OpenAI's and vLLM's default); a
# chat without one, the rest of the context, which is this long where the model's is not
# known (an external endpoint).
COMPLETION_DEFAULT_TOKENS = 16
UNKNOWN_CONTEXT_TOKENS = 4096


def reserved_completion_tokens(body: dict[str, Any], kind: str, max_model_len: int | None,
                               prompt_tokens: int) -> int:
    """The completion tokens a request may make: n x max_tokens, or n x what the engine
    would allow without one (reserved against the token budget at admission; the
    difference to what was used is settled at the end)."""
    if kind == "embedding":
        return 0
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        most = (COMPLETION_DEFAULT_TOKENS if kind == "completion" else
                max(1, (max_model_len or UNKNOWN_CONTEXT_TOKENS) - prompt_tokens))
    return most * n


def well_formed(key: str) -> bool:
    """Whether a key could be one of ours (`fp-` and URL-safe characters), so a flood of
    made-up strings costs no database lookups."""
    return KEY_SHAPE.fullmatch(key) is not None


# `fp-` and URL-safe ASCII characters, 16 to 200 in all.
KEY_SHAPE = re.compile(r"fp-[A-Za-z0-9_-]{13,197}")


def prompt_prefix(body: dict[str, Any], kind: str) -> str | None:
    """The start of the prompt, for prefix-affinity routing."""
    if kind == "chat":
        parts = []
        for message in body.get("messages") or []:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                parts.append(message["content"])
            if sum(map(len, parts)) >= 256:
                break
        return "\n".join(parts)[:256] or None
    prompt = body.get("prompt")
    return prompt[:256] if isinstance(prompt, str) and prompt else None
