"""A FAKE OpenAI-compatible engine for tests and benchmarks, not an inference server.

It streams N tokens at a configured pace (at 0, as fast as it can), answers /health and
/v1/models, and serves /metrics with vLLM's metric names and meaning (requests running and
waiting, KV-cache use, TTFT and inter-token histograms). Every token is the word "tok".
Streams take turns, a token each, as vLLM's continuous batching gives every running
request one token a step: an unpaced stream gives way to the others after each token
(`--serial`: it does not, and since uvicorn's `send` waits only while the socket is full,
whole streams then go out one after another).

Given a key (--api-key, or VLLM_API_KEY in its environment, as vLLM takes it) it refuses
/v1/* without `Authorization: Bearer <key>` exactly as vLLM does: 401 with
{"error": "Unauthorized"}; /health and /metrics stay open, as they are in vLLM. Like vLLM
it loads `--middleware module.Class` ASGI middleware around itself (the local backend's
engine guard, serving/engine_guard.py, which closes every other path too).

    python -m fakes.engine --port 9001 [--token-interval-ms 10] [--model fake] [--api-key K]
                           [--middleware module.Class] [--stamp] [--serial]
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import importlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
# The paths vLLM's AuthenticationMiddleware guards when it has a key.
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


async def read_body(receive: Receive) -> bytes:
    """A request's whole body, however many messages it came in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.total += times
        self.sum += value * times
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += times

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{bound}"}} {count}'
               for bound, count in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.total}')
        out.append(f"{name}_count{{{labels}}} {self.total}")
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        return out


class FakeEngine:
    def __init__(self, model: str, token_interval: float, max_running: int = 256,
                 api_key: str = "", stamp: bool = False, serial: bool = False) -> None:
        self.model = model
        # Unpaced, send a stream's tokens back to back, the loop's other work waiting.
        self.serial = serial
        # Stamp each stream's first event with when its request arrived and when the event
        # was sent (its id: fake-ARRIVED-SENT, CLOCK_MONOTONIC nanoseconds, the clock every
        # process on the machine shares): the load client tells from them where a request's
        # time to first token went, before the engine, in it, or after it.
        self.stamp = stamp
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else b""
        self.refused = 0  # requests refused for a missing or wrong key
        self.token_interval = token_interval
        self.max_running = max_running
        self.running = 0
        self.waiting = 0
        self.requests = 0
        self.disconnects = 0
        self.finished = 0
        self.prompt_tokens = 0
        self.generated = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.seen_prompts: set[int] = set()
        self.priorities: dict[int, int] = {}  # requests per `priority` field value
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.slots = asyncio.Semaphore(max_running)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if (self.expected_auth and method != "OPTIONS" and path.startswith(GUARDED_PREFIX)
                and not self.authorized(scope)):
            self.refused += 1
            await respond(send, 401, b'{"error": "Unauthorized"}')
            return
        if method == "GET" and path == "/health":
            await respond(send, 200, b"", "text/plain")
        elif method == "GET" and path == "/v1/models":
            await respond(send, 200, json.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "fake",
                 "max_model_len": 2048}]}).encode())
        elif method == "GET" and path == "/metrics":
            await respond(send, 200, self.metrics().encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self.complete(scope, receive, send, chat=path.endswith("chat/completions"))
        elif method == "POST" and path == "/invocations":
            # vLLM's SageMaker route: a chat completion, outside vLLM's own key check.
            await self.complete(scope, receive, send, chat=True)
        elif method == "POST" and path == "/tokenize":
            await respond(send, 200, json.dumps({"count": 1, "max_model_len": 2048,
                                                 "tokens": [1]}).encode())
        else:
            await respond(send, 404, b'{"error": {"message": "not found", "code": 404}}')

    def authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # As vLLM's AuthenticationMiddleware: the scheme in any case, the token exact.
        return hmac.compare_digest(b"Bearer " + token,
                                   self.expected_auth) and scheme.lower() == b"bearer"

    async def complete(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        arrived = time.perf_counter_ns()
        body = await read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            await respond(send, 400, b'{"error": {"message": "bad JSON", "code": 400}}')
            return
        if request.get("model") != self.model:
            await respond(send, 404, json.dumps({"error": {
                "message": f"The model `{request.get('model')}` does not exist.",
                "type": "NotFoundError", "code": 404}}).encode())
            return
        tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        self.requests += 1
        if isinstance(request.get("priority"), int):
            self.priorities[request["priority"]] = self.priorities.get(
                request["priority"], 0) + 1
        # Prefix caching, faked: every prompt counts 5 tokens, all of them hits when the
        # same prompt was seen before.
        prompt = hash(json.dumps(request.get("messages") or request.get("prompt")))
        self.prompt_tokens += 5
        self.prefix_queries += 5
        if prompt in self.seen_prompts:
            self.prefix_hits += 5
        elif len(self.seen_prompts) < 10_000:
            self.seen_prompts.add(prompt)
        self.waiting += 1
        async with self.slots:
            self.waiting -= 1
            self.running += 1
            try:
                if request.get("stream"):
                    await self.stream(send, receive, request, tokens, chat, arrived)
                else:
                    await self.whole(send, tokens, chat)
                    self.generated += tokens
                self.finished += 1
            finally:
                self.running -= 1

    async def whole(self, send: Send, tokens: int, chat: bool) -> None:
        started = time.perf_counter()
        if self.token_interval:
            await asyncio.sleep(self.token_interval * tokens)
        # Like vLLM, the latency histograms count answers that are not streamed too: the
        # first token at one interval, the rest one interval apart.
        self.ttft.observe(self.token_interval or time.perf_counter() - started)
        if tokens > 1:
            self.itl.observe(self.token_interval, tokens - 1)
        text = " tok" * tokens
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "length"} if chat else
                                  {"index": 0, "text": text, "finish_reason": "length"})
        await respond(send, 200, json.dumps({
            "id": "fake-1", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                      "total_tokens": tokens + 5}}).encode())

    async def stream(self, send: Send, receive: Receive, request: dict[str, Any], tokens: int,
                     chat: bool, arrived: int = 0) -> None:
        # Like vLLM, stop generating when the client goes away.
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                continue
            gone.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._stream(send, gone, request, tokens, chat, arrived)
        finally:
            watcher.cancel()

    async def _stream(self, send: Send, gone: asyncio.Event, request: dict[str, Any],
                      tokens: int, chat: bool, arrived: int) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        started = time.perf_counter()
        last = started
        kind = "chat.completion.chunk" if chat else "text_completion"
        prefix = (f'{{"id":"fake-1","object":"{kind}","created":{int(time.time())},'
                  f'"model":"{self.model}","choices":[').encode()
        piece = (b'{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}' if chat
                 else b'{"index":0,"text":" tok","finish_reason":null}]}')
        event = b"data: " + prefix + piece + b"\n\n"
        options = request.get("stream_options") or {}
        # Like vLLM's `continuous_usage_stats`: the usage so far on every chunk.
        running = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
        for index in range(tokens):
            if self.token_interval:
                await asyncio.sleep(self.token_interval)
            elif not self.serial:
                await asyncio.sleep(0)  # the other running streams' turn, as a step
            if gone.is_set():
                self.disconnects += 1
                return
            if running:
                event = (b"data: " + prefix + piece[:-1] + b',"usage":' + json.dumps({
                    "prompt_tokens": 5, "total_tokens": index + 6,
                    "completion_tokens": index + 1}).encode() + b"}\n\n")
            body = event
            if index == 0 and self.stamp:
                body = event.replace(b'"id":"fake-1"', b'"id":"fake-%d-%d"' % (
                    arrived, time.perf_counter_ns()), 1)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            self.generated += 1
            now = time.perf_counter()
            if index == 0:
                self.ttft.observe(now - started)
            else:
                self.itl.observe(now - last)
            last = now
        finish = (b'{"index":0,"delta":{},"finish_reason":"length"}]}' if chat
                  else b'{"index":0,"text":"","finish_reason":"length"}]}')
        tail = b"data: " + prefix + finish + b"\n\n"
        if options.get("include_usage"):
            usage = json.dumps({"prompt_tokens": 5, "completion_tokens": tokens,
                                "total_tokens": tokens + 5}).encode()
            tail += b"data: " + prefix + b'],"usage":' + usage + b"}\n\n"
        tail += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {self.waiting}",
            "# TYPE fake:requests_total counter",
            f"fake:requests_total {self.requests}",
            "# TYPE fake:requests_by_priority_total counter",
            *(f'fake:requests_by_priority_total{{priority="{level}"}} {count}'
              for level, count in sorted(self.priorities.items())),
            "# TYPE fake:client_disconnects_total counter",
            f"fake:client_disconnects_total {self.disconnects}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {min(self.running / self.max_running, 1)}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {self.generated}",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {self.finished}',
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {self.prefix_queries}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {self.prefix_hits}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} 0",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *self.ttft.lines("vllm:time_to_first_token_seconds", labels),
            "# TYPE vllm:inter_token_latency_seconds histogram",
            *self.itl.lines("vllm:inter_token_latency_seconds", labels),
        ]
        return "\n".join(lines) + "\n"


class PerPort:
    """One fake engine per listening port, in one process: each endpoint has its own
    counters and queues, as separate replicas would."""

    def __init__(self, model: str, token_interval: float, api_key: str = "",
                 stamp: bool = False, serial: bool = False) -> None:
        self.model, self.token_interval, self.api_key = model, token_interval, api_key
        self.stamp, self.serial = stamp, serial
        self.engines: dict[int, FakeEngine] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        port = (scope.get("server") or ("", 0))[1]
        engine = self.engines.get(port)
        if engine is None:
            engine = self.engines[port] = FakeEngine(self.model, self.token_interval,
                                                     api_key=self.api_key, stamp=self.stamp,
                                                     serial=self.serial)
        await engine(scope, receive, send)


def with_middleware(app: Any, paths: list[str]) -> Any:
    """`app` wrapped in each middleware class named `module.Class`, as vLLM's --middleware
    adds them (the last named outermost)."""
    for path in paths:
        module, _, name = path.rpartition(".")
        app = getattr(importlib.import_module(module), name)(app)
    return app


async def respond(send: Send, status: int, body: bytes,
                  content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--token-interval-ms", type=float, default=10.0)
    parser.add_argument("--max-running", type=int, default=256,
                        help="requests generated at once; more wait, like vLLM's max_num_seqs")
    parser.add_argument("--extra-ports", type=int, default=0, metavar="N",
                        help="also listen on N more free ports (one fake engine answering "
                             "as many endpoints), written one per line to --ports-file")
    parser.add_argument("--ports-file", default="")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", ""),
                        help="refuse /v1/* without this bearer key (default: VLLM_API_KEY)")
    parser.add_argument("--middleware", action="append", default=[],
                        help="an ASGI middleware class to load around the engine, as vLLM")
    parser.add_argument("--keep-alive", type=float, default=5.0, metavar="SECONDS",
                        help="close a kept-alive connection idle this long (default 5, "
                             "uvicorn's and vLLM's)")
    parser.add_argument("--stamp", action="store_true",
                        help="give each stream's first event the id fake-ARRIVED-SENT: when "
                             "its request arrived and when the event was sent, in "
                             "CLOCK_MONOTONIC nanoseconds (for the load client's legs)")
    parser.add_argument("--serial", action="store_true",
                        help="with --token-interval-ms 0: send each stream's tokens back to "
                             "back, not a token a turn (whole streams one after another)")
    options = parser.parse_args()
    if options.keep_alive <= 0:
        parser.error("--keep-alive takes a number of seconds above 0")
    if options.serial and options.token_interval_ms:
        parser.error("--serial goes with --token-interval-ms 0 (a paced stream always "
                     "waits between its tokens)")
    import uvicorn

    if not options.extra_ports:
        engine = FakeEngine(options.model, options.token_interval_ms / 1000,
                            options.max_running, api_key=options.api_key,
                            stamp=options.stamp, serial=options.serial)
        uvicorn.run(with_middleware(engine, options.middleware), host=options.host,
                    port=options.port, log_level="warning", access_log=False, lifespan="on",
                    timeout_keep_alive=options.keep_alive)
        return
    import socket

    sockets = []
    for port in [options.port] + [0] * options.extra_ports:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((options.host, port))
        listener.listen(128)
        sockets.append(listener)
    if options.ports_file:
        with open(options.ports_file, "w") as out:
            out.write("".join(f"{s.getsockname()[1]}\n" for s in sockets))
    server = uvicorn.Server(uvicorn.Config(with_middleware(PerPort(
                                               options.model, options.token_interval_ms / 1000,
                                               options.api_key, options.stamp,
                                               options.serial),
                                               options.middleware),
                                           log_level="warning", access_log=False,
                                           lifespan="on",
                                           timeout_keep_alive=options.keep_alive))
    server.run(sockets=sockets)


if __name__ == "__main__":
    main()
