"""What a call leaves behind once it ends: the gateway's metrics, its log line, its usage
record (written off the hot path, in batches) and the tokens owed to its key's budget."""

from __future__ import annotations

import logging
import time
from typing import Any

from serving import metrics
from serving.gateway.call import Call
from serving.ratelimit import Limit, token_charges
from serving.usage import Usage, UsageWriter

logger = logging.getLogger("serving.gateway")


def record(writer: UsageWriter | None, call: Call, replica: str, status: int,
           usage: dict[str, Any] | None) -> None:
    """The call's metrics, log line and usage record (`replica` "" when none took it)."""
    timing, model = call.timing, call.model
    end = timing.last_chunk or time.perf_counter()
    metrics.child(metrics.REQUESTS, model, call.deployment, str(status)).inc()
    metrics.child(metrics.E2E, model).observe(end - timing.arrived)
    ttft = timing.first_byte - timing.arrived if timing.first_byte else None
    if ttft is not None:
        metrics.child(metrics.TTFT, model).observe(ttft)
    itl = timing.gaps / (timing.chunks - 1) if timing.chunks > 1 else None
    if itl is not None:
        metrics.child(metrics.ITL, model).observe(itl)
    prompt = completion = None
    if usage:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            metrics.child(metrics.TOKENS, model, "prompt").inc(prompt)
        if isinstance(completion, int):
            metrics.child(metrics.TOKENS, model, "completion").inc(completion)
    logger.info("%s %s %s -> %s %s %.1f ms", call.request_id, model, call.deployment,
                replica or "-", status, (end - timing.arrived) * 1000)
    if writer is not None:
        writer.add(Usage(
            at=time.time(), request_id=call.request_id,
            key_id=call.key.key_id if call.key else None, username=call.user, model=model,
            deployment=call.deployment, replica=replica, status=status, stream=call.stream,
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            completion_tokens=completion if isinstance(completion, int) else None,
            queue_ms=(timing.sent - timing.arrived) * 1000 if timing.sent else 0.0,
            ttft_ms=ttft * 1000 if ttft is not None else None,
            itl_ms=itl * 1000 if itl is not None else None,
            e2e_ms=(end - timing.arrived) * 1000))


def tokens_owed(call: Call, status: int, usage: dict[str, Any] | None) -> list[Limit]:
    """What the key's token budgets are owed once the answer has ended: what was used,
    less what admission charged (the prompt's estimate and the reserved completion);
    more is charged, less given back."""
    key = call.key
    if key is None or not (key.tpm or key.team_tpm):
        return []
    # A stream the client left has no usage: its relayed events count instead. A
    # non-streamed answer the client left, or one cut off, has no count either: what it
    # may have made, its reservation, stays charged.
    completion = (usage or {}).get("completion_tokens")
    prompt = (usage or {}).get("prompt_tokens")
    if not isinstance(completion, int):
        completion = (call.timing.events if call.stream else
                      call.reserved if status in (499, 502) else 0)
    return token_charges(key, completion, prompt if isinstance(prompt, int) else None,
                         call.prompt_tokens, call.reserved)
