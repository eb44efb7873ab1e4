"""The answer relayed to an HTTP client: a stream as it arrives (whatever bytes are
buffered, in one write, the usage event taken out unless the client asked for it), or a
whole answer read up to GATEWAY_MAX_RESPONSE_BYTES, errors put in OpenAI's shape.

A client that disconnects has its upstream closed (the engine frees the request's cache);
a replica that fails mid-stream ends the stream with an SSE error event; a key revoked
mid-stream has its stream cut off with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from serving.calls import GatewayError
from serving.gateway.call import Call, Receive, Send
from serving.gateway.placement import first_done, wait_for_disconnect
from serving.gateway.resources import Resources
from serving.hot_settings import hot
from serving.session import Stream
from serving.upstream import Pipe, Response, UpstreamError, run_eagerly, start

Headers = list[tuple[bytes, bytes]]
UPSTREAM_MESSAGE_CHARS = 1000


async def relay(resources: Resources, call: Call, stream: Stream, send: Send,
                headers: Headers) -> None:
    """Relay the replica's answer to the client, and say on `stream` how it went."""
    content_type = stream.response.headers.get("content-type", "application/json")
    out_headers = [*headers, (b"content-type", content_type.encode())]
    if call.stream and stream.status == 200:
        out_headers.append((b"cache-control", b"no-cache"))
        await relay_stream(resources, call, stream, send, out_headers)
    else:
        await relay_whole(call, stream, send, headers, out_headers)


async def relay_whole(call: Call, stream: Stream, send: Send, headers: Headers,
                      out_headers: Headers) -> None:
    """A whole answer, once read; errors in OpenAI's shape."""
    assert call.receive is not None
    response = stream.response
    try:
        payload = await read_unless_gone(response, call.receive,
                                         hot.GATEWAY_MAX_RESPONSE_BYTES)
    except ResponseTooLarge as exc:
        response.close()
        stream.status = 502
        raise GatewayError(502, str(exc), kind="upstream_error",
                           code="response_too_large") from None
    except UpstreamError as exc:
        stream.broke()
        stream.status = 502
        raise GatewayError(502, f"the replica failed while answering ({exc})",
                           kind="upstream_error", code="upstream_error") from None
    if payload is None:  # the client went away; closing tells the engine
        response.close()
        stream.status = 499
        return
    call.timing.first_byte = call.timing.last_chunk = time.perf_counter()
    status = stream.status
    if not 200 <= status < 300:
        # Clients parse errors in OpenAI's shape; an engine or an external endpoint may
        # answer plain text ("404: Not Found") or another JSON.
        payload = upstream_error_body(status, payload)
        out_headers = [*headers, (b"content-type", b"application/json")]
    await respond(send, status, payload, out_headers)
    usage = None
    if status == 200:
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(payload)
            usage = parsed.get("usage") if isinstance(parsed, dict) else None
    stream.ended(usage)


async def relay_stream(resources: Resources, call: Call, stream: Stream, send: Send,
                       headers: Headers) -> None:
    """Relay a stream as it comes, until it ends, the client goes or the key is revoked.

    What the replica has sent already goes out at once, in the write that carries the
    head (controlplane/http_protocol.py); an answer already whole by then (a short
    completion) is relayed without a task of its own."""
    response = stream.response
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    found: dict[str, Any] = {}
    events = EventRelay(send, call, found)
    pump = run_eagerly(relay_events(events, response))
    if not pump.done():
        await follow_relay(resources, call, pump, events)
    # The final usage event, else (a stream the client left, cut off or broken) the
    # usage so far on the last chunk relayed, where the engine reports it.
    stream.usage = found.get("usage") or last_running_usage(found.get("last", b""))
    if resources.streams.was_cut(pump):  # the key was revoked or expired mid-stream
        response.close()
        await send_error_event(send, "the API key was revoked or has expired; the answer "
                                     "was cut off", "authentication_error", "api_key_revoked")
    elif call.client_left or not pump.done():  # the client went away: the engine sees it
        pump.cancel()  # and frees its cache
        response.close()
        stream.status = 499  # recorded as the client's leaving, with the tokens relayed
        stream.ended()
    else:
        await end_stream(stream, send, pump.exception())


async def follow_relay(resources: Resources, call: Call, pump: asyncio.Future[None],
                       events: EventRelay) -> None:
    """Wait while the relay that had to wait runs in its task, until it ends or the
    client goes; the key's streams are cut off with it if it is revoked meanwhile. One
    task per stream, none per chunk: the relay's. The server calls back when the client
    goes (controlplane/http_protocol.py), which stops the relay; under a server without
    that callback a second task waits on `receive` for it."""
    when_lost = call.when_lost
    watcher: asyncio.Task[None] | None = None
    key_hash = call.key.key_hash if call.key is not None else ""
    if key_hash:
        resources.streams.add(key_hash, pump)
    try:
        if when_lost is not None:
            when_lost(functools.partial(client_left, call, pump))
            await first_done(pump)
        else:
            assert call.receive is not None
            watcher = asyncio.get_running_loop().create_task(
                wait_for_disconnect(call.receive))
            await first_done(pump, watcher)
            if events.ended and not pump.done():
                # The answer went out whole from the socket's callback, which ends the
                # client's side too (its receive says so): not a client that left. The
                # relay returns on its next step.
                await asyncio.wait({pump})
    except asyncio.CancelledError:
        pump.cancel()
        raise
    finally:
        if when_lost is not None:
            when_lost(None)
        if watcher is not None:
            watcher.cancel()
        if key_hash:
            resources.streams.discard(key_hash, pump)


def client_left(call: Call, pump: asyncio.Future[None]) -> None:
    """The server's callback when the client goes mid-stream: the relay stops."""
    call.client_left = True
    pump.cancel()


async def end_stream(stream: Stream, send: Send, error: BaseException | None) -> None:
    """A relay that ended by itself: read to its end, or a replica that failed mid-stream
    (its SSE error event); any other failure is raised."""
    if isinstance(error, UpstreamError):
        stream.broke()
        await send_error_event(send, f"the replica failed mid-stream ({error})",
                               "upstream_error", 502)
    elif error is not None:
        raise error
    else:
        stream.ended()


async def send_error_event(send: Send, message: str, kind: str, code: str | int) -> None:
    """End a stream with an SSE error event (the client may be gone already)."""
    event = {"error": {"message": message, "type": kind, "code": code}}
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body",
                    "body": b"data: " + orjson.dumps(event) + b"\n\n", "more_body": False})


async def relay_events(events: EventRelay, response: Response) -> None:
    """Relay the upstream as it arrives: whatever bytes one read of the replica's socket
    brought, in one write, handed over from the socket's callback (no wake-up of this
    task per chunk unless the client reads slower than the replica writes); the end of
    the answer in the same write as its last bytes when they came together."""
    try:
        await response.deliver(events.take, events.pipe)
    finally:
        events.count_piped()
    if not events.ended:
        await events.send({"type": "http.response.body", "body": events.pending,
                           "more_body": False})


class EventRelay:
    """The complete SSE events of each chunk to the client (an event cut between chunks
    waits for its end); the final usage event taken out unless asked for, the usage so
    far too where the replica adds it; the chunks timed and the events counted."""

    __slots__ = ("call", "ended", "found", "pending", "pipe", "send", "strip", "timing",
                 "write_body")

    def __init__(self, send: Send, call: Call, found: dict[str, Any]) -> None:
        self.send, self.call, self.found, self.timing = send, call, found, call.timing
        self.write_body = call.write_body  # the server's own, where it has one
        self.pending = b""
        self.strip = call.running_usage and not call.wants_running_usage
        self.ended = False  # the client's answer was ended (with the last bytes)
        # Chunks of complete events, but the usage event, go to the client as they came
        # where the server offers a pipe; not where the usage so far is read from each.
        self.pipe: Pipe | None = None
        if call.pipe_to is not None and self.write_body is not None and not call.running_usage:
            self.pipe = Pipe(ending=b"\n\n", refused=b'"choices":[]', counted=b"data: {")
            call.pipe_to(self.pipe)

    def count_piped(self) -> None:
        """The chunks piped since last asked, timed and counted as `take` does."""
        if self.pipe is None or not self.pipe.chunks:
            return
        chunks, events, first, last = self.pipe.take_counts()
        timing = self.timing
        if timing.chunks == 0:
            timing.first_byte = first
        else:
            timing.gaps += first - timing.last_chunk
        timing.gaps += last - first  # (the gaps between them, summed)
        timing.last_chunk = last
        timing.chunks += chunks
        timing.events += events

    def take(self, chunk: bytes, last: bool) -> Awaitable[None] | None:
        """One chunk in (`last`: the answer ends with it); what the send must still wait
        on, if anything."""
        if self.pipe is not None and self.pipe.chunks:  # chunks piped before this one
            self.count_piped()
        timing = self.timing
        now = time.perf_counter()
        if timing.chunks == 0:
            timing.first_byte = now
        else:
            timing.gaps += now - timing.last_chunk
        timing.last_chunk = now
        timing.chunks += 1
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            if self.pipe is not None:
                self.pipe.behind = True  # the next chunk must follow these bytes
            return self.end(b"") if last else None
        if cut + 2 == len(data):
            complete, self.pending = data, b""
        else:
            complete, self.pending = data[: cut + 2], data[cut + 2:]
        if self.pipe is not None:
            self.pipe.behind = bool(self.pending)
        timing.events += complete.count(b"data: {")
        # `find`, not `in`: bytes' `in` first tries its argument as an integer and raises
        # (and clears) a TypeError for every bytes argument.
        if complete.find(b'"usage"') >= 0 and complete.find(b'"choices":[]') >= 0:
            complete, self.found["usage"] = take_usage(complete, keep=self.call.wants_usage)
        if self.call.running_usage and complete:
            self.found["last"] = complete
            if self.strip:
                complete = strip_running_usage(complete)
        if last:
            return self.end(complete)
        if not complete:
            return None
        if self.write_body is not None and self.write_body(complete, True):
            return None
        return start(self.send({"type": "http.response.body", "body": complete,
                                "more_body": True}))

    def end(self, complete: bytes) -> Awaitable[None] | None:
        """The last events, and whatever partial event is left, in the answer's last
        write."""
        self.ended = True
        body, self.pending = complete + self.pending, b""
        if self.write_body is not None and self.write_body(body, False):
            return None
        return start(self.send({"type": "http.response.body", "body": body,
                                "more_body": False}))


# vLLM's usage so far on a chunk (`continuous_usage_stats`): `,"usage":{...}` after the
# choices; the final usage event, whose choices are empty (`[]`), is left to take_usage.
USAGE_KEY = b',"usage":{'


def strip_running_usage(events: bytes) -> bytes:
    """The events without the usage so far on each. Found with bytes.find, not a regular
    expression: this runs on every chunk of a stream from a replica the control plane
    runs, and a regex scan of one event took 13 µs where this takes about 1."""
    start_at = events.find(USAGE_KEY)
    kept: list[bytes] = []
    done = 0
    while start_at >= 0:
        end = object_end(events, start_at + len(USAGE_KEY))
        if end < 0:  # cut short: nothing more to take out
            break
        if events[max(0, start_at - 2):start_at] != b"[]":
            kept.append(events[done:start_at])
            done = end
        start_at = events.find(USAGE_KEY, end)
    if not kept:
        return events
    kept.append(events[done:])
    return b"".join(kept)


def object_end(data: bytes, position: int) -> int:
    """Just past the `}` that closes the JSON object whose inside begins at `position`
    (numbers, nulls and nested objects, as a usage holds: no string with a brace), or -1
    when it does not close."""
    depth = 1
    while depth:
        close = data.find(b"}", position)
        if close < 0:
            return -1
        opening = data.find(b"{", position, close)
        if opening >= 0:
            depth, position = depth + 1, opening + 1
        else:
            depth, position = depth - 1, close + 1
    return position


def last_running_usage(events: bytes) -> dict[str, Any] | None:
    """The usage so far on the last of these chunks that carries one, or None."""
    start = events.rfind(b'"usage":{')
    if start < 0:
        return None
    begin = events.rfind(b"data: {", 0, start)
    end = events.find(b"\n\n", start)
    try:
        usage = orjson.loads(events[begin + 6: end if end >= 0 else len(events)])["usage"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return usage if isinstance(usage, dict) else None


def take_usage(events: bytes, *, keep: bool) -> tuple[bytes, dict[str, Any] | None]:
    """Find the usage event among complete SSE events; drop it unless the client asked."""
    usage = None
    kept = []
    for event in events.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage"' in event:
            with contextlib.suppress(orjson.JSONDecodeError):
                usage = orjson.loads(event[6:]).get("usage")
            if not keep:
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept), usage


class ResponseTooLarge(Exception):
    """The replica's answer is over GATEWAY_MAX_RESPONSE_BYTES."""


async def read_capped(response: Response, limit: int) -> bytes:
    """The whole upstream body, unless it grows beyond `limit` bytes."""
    parts, size = [], 0
    while chunk := await response.readany():
        size += len(chunk)
        if size > limit:
            raise ResponseTooLarge(f"the replica's answer is over the limit of {limit} bytes "
                                   f"(GATEWAY_MAX_RESPONSE_BYTES); ask for less, or stream it")
        parts.append(chunk)
    return b"".join(parts)


async def read_unless_gone(response: Response, receive: Receive, limit: int
                           ) -> bytes | None:
    """The whole upstream body (at most `limit` bytes), or None when the client
    disconnects first. A body already read whole needs no task to wait for it."""
    reading = run_eagerly(read_capped(response, limit))
    if reading.done():
        return reading.result()
    watcher = asyncio.get_running_loop().create_task(wait_for_disconnect(receive))
    try:
        await first_done(reading, watcher)
    finally:
        watcher.cancel()
    if not reading.done():
        reading.cancel()
        return None
    return reading.result()


def upstream_error_body(status: int, payload: bytes) -> bytes:
    """An upstream error answer in OpenAI's shape: `{"error": {...}}` (vLLM's own, since
    0.10) passes as it is; vLLM's older `{"object": "error", "message": ...}` and
    FastAPI's `{"detail": ...}` are wrapped; anything else becomes the message, cut to a
    readable length. The status is kept by the caller."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            if isinstance(error.get("type"), str) and "param" in error and "code" in error:
                return payload
            return orjson.dumps({"error": {  # the fields a client reads, always there
                **error, "type": error["type"] if isinstance(error.get("type"), str)
                else "upstream_error", "param": error.get("param"),
                "code": error.get("code")}})
        if parsed.get("object") == "error" and isinstance(parsed.get("message"), str):
            return orjson.dumps({"error": {
                "message": parsed["message"][:UPSTREAM_MESSAGE_CHARS],
                "type": str(parsed.get("type") or "upstream_error"),
                "param": parsed.get("param") if isinstance(parsed.get("param"), str)
                else None,
                "code": parsed.get("code")}})
        if isinstance(parsed.get("detail"), str):
            payload = parsed["detail"].encode()
    text = payload.decode("utf-8", "replace").strip()
    if len(text) > UPSTREAM_MESSAGE_CHARS:
        text = text[:UPSTREAM_MESSAGE_CHARS] + "…"
    return orjson.dumps({"error": {
        "message": text or f"the upstream answered HTTP {status} with no body",
        "type": "upstream_error", "param": None, "code": "upstream_error"}})


async def respond(send: Send, status: int, body: bytes, headers: Headers) -> None:
    """A whole answer, with its length (and a JSON content type unless one is given)."""
    names = {name for name, _ in headers}
    extra = [] if b"content-type" in names else [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + extra + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
