"""What an HTTP caller may do before a call is placed: its key (and the count of failed
attempts from its address), the size of its body, its requests in flight and its rate
limits."""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings

from serving import metrics
from serving.admission import retry_after_header
from serving.calls import GatewayError, well_formed
from serving.gateway.call import Call, Receive, Scope, header
from serving.gateway.resources import Resources
from serving.hot_settings import hot
from serving.keys import KeyInfo, KeysUnavailable, authenticate
from serving.ratelimit import Limit, key_limits

logger = logging.getLogger("serving.gateway")


async def authenticate_caller(resources: Resources, scope: Scope) -> KeyInfo:
    """The caller's key. Unknown, revoked, expired, forged and truncated keys all get
    the same 401. Failed attempts are counted per client address: beyond
    GATEWAY_AUTH_FAILURES_PER_MINUTE, further failed attempts get 429. A request with
    a valid key is never refused by that count, so one client guessing keys behind a
    shared address (an ingress, a NAT) cannot lock the others out."""
    try:
        return await check_key(scope)
    except GatewayError as refused:
        if refused.status != 401 or not settings.GATEWAY_AUTH_FAILURES_PER_MINUTE:
            raise
        address = (scope.get("client") or ("-", 0))[0]
        failures = Limit("requests", f"authfail:{address}",
                         settings.GATEWAY_AUTH_FAILURES_PER_MINUTE, 1)
        try:
            verdict = await resources.limiter.admit([failures])  # counts this attempt
        except Exception:  # no count to go by: the attempt is answered as it is
            logger.exception("could not count a failed authentication attempt")
            raise refused from None
        if verdict.allowed:
            raise
    metrics.child(metrics.REFUSED, "-", "auth_failures").inc()
    raise GatewayError(429, "too many failed authentication attempts from this address",
                       kind="rate_limit_error", code="too_many_auth_failures",
                       headers=[retry_after_header(verdict.retry_after)])


async def check_key(scope: Scope) -> KeyInfo:
    """The key in the Authorization header, looked up (through the key cache)."""
    value = header(scope, b"authorization")
    if not value:
        raise GatewayError(401, "missing API key: send Authorization: Bearer <key>",
                           kind="authentication_error", code="missing_api_key")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise GatewayError(401, "use Authorization: Bearer <key>",
                           kind="authentication_error", code="invalid_api_key")
    key = key.strip()
    if not well_formed(key):  # no key of ours looks like this: no lookup to make
        info = None
    else:
        try:
            info = await authenticate(key)
        except KeysUnavailable:
            logger.exception("could not check an API key")
            raise GatewayError(503, "API keys cannot be checked now (the database is "
                                    "unreachable); try again shortly",
                               kind="service_unavailable", code="keys_unavailable",
                               headers=[(b"retry-after", b"2")]) from None
    if info is None:
        raise GatewayError(401, "invalid or revoked API key", kind="authentication_error",
                           code="invalid_api_key")
    return info


async def read_body(scope: Scope, receive: Receive) -> bytes:
    """The request body, at most GATEWAY_MAX_BODY_BYTES (else 413)."""
    limit = hot.GATEWAY_MAX_BODY_BYTES
    declared = header(scope, b"content-length")
    # isdigit() alone takes "¹" (a latin-1 header byte) for a digit int() refuses.
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body over the limit of {limit} bytes",
                           code="request_too_large")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body over the limit of {limit} bytes",
                               code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def hold_for_key(in_flight: dict[int, int], key: KeyInfo) -> None:
    """Count a request against its key's GATEWAY_KEY_MAX_IN_FLIGHT (429 beyond it); the
    caller lets go with `let_go_for_key` when the request ends."""
    held = in_flight.get(key.key_id, 0)
    most = hot.GATEWAY_KEY_MAX_IN_FLIGHT
    if most and held >= most:
        metrics.child(metrics.REFUSED, "-", "key_in_flight").inc()
        raise GatewayError(429, f"this API key already has {held} requests in flight "
                                f"(at most {most}); wait for one to finish",
                           kind="rate_limit_error", code="too_many_requests_in_flight",
                           headers=[(b"retry-after", b"1")])
    in_flight[key.key_id] = held + 1


def let_go_for_key(in_flight: dict[int, int], key: KeyInfo) -> None:
    """A request of this key has ended."""
    left = in_flight.get(key.key_id, 1) - 1
    if left > 0:
        in_flight[key.key_id] = left
    else:
        in_flight.pop(key.key_id, None)


async def charge_rate_limits(resources: Resources, call: Call
                             ) -> list[tuple[bytes, bytes]]:
    """Charge the call to its key's and team's rate limits (into `call.limits`, given back
    if no replica answers); returns the x-ratelimit-* headers."""
    assert call.key is not None
    limits = key_limits(call.key, call.prompt_tokens, call.reserved)
    if not limits:
        return []
    try:
        verdict = await resources.limiter.admit(limits)
    except Exception:
        logger.exception("could not check the rate limits")
        raise GatewayError(503, "the rate limits cannot be checked now (their store is "
                                "unreachable); try again shortly",
                           kind="service_unavailable", code="limits_unavailable",
                           headers=[(b"retry-after", b"1")]) from None
    if not verdict.allowed:
        metrics.child(metrics.REFUSED, call.deployment, "rate_limit").inc()
        raise GatewayError(429, "rate limit reached for this API key or its team; see the "
                                "x-ratelimit-* headers",
                           kind="rate_limit_error", code="rate_limit_exceeded",
                           headers=verdict.headers())
    call.limits = limits
    return verdict.headers()
