"""The load client of the gateway benchmarks: `streams` concurrent clients, each sending
streamed completions one after another, timing each one's first token and counting the
events received; and each round's burst (from its start until every stream had its first
token) with how many cores the whole machine kept busy meanwhile (psutil's system-wide
CPU times), which tells whether a burst's TTFT waits for a full machine or for one busy
process. Where the engine stamps each stream's first event (fakes/engine.py --stamp), each
request's time to first token is split in three legs: from the client's send until the
engine had the request, in the engine until it sent the first token, and from there until
the client read it. Used by bench/gateway_overhead.py and the benchmarks built on it."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Run:
    ttfts: list[float]
    tokens: int
    seconds: float
    errors: int
    # The burst: from the start until every stream had its first token, in seconds, and
    # the CPU seconds the whole machine (every process, every core) spent meanwhile.
    burst_seconds: float = 0.0
    burst_busy: float = 0.0
    # Per request the engine stamped: seconds to the engine, in it, and back to the client.
    legs: list[tuple[float, float, float]] = field(default_factory=list)

    def p(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


async def load(url: str, model: str, streams: int, tokens: int, key: str | None,
               rounds: int) -> Run:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "Count with me:", "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    ttfts: list[float] = []
    legs: list[tuple[float, float, float]] = []
    counted = 0
    errors = 0
    firsts = 0  # streams whose first request has had its first token (or failed)
    burst: list[float] = []  # when the last of them came, and the machine's busy CPU
    connector = aiohttp.TCPConnector(limit=0)

    def stream_started() -> None:
        nonlocal firsts
        firsts += 1
        if firsts == streams:
            burst.extend((time.perf_counter(), machine_busy_seconds()))
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal counted, errors
            for request in range(rounds):
                started = time.perf_counter()
                first = None
                try:
                    async with session.post(f"{url}/v1/completions", json=body,
                                            headers=headers) as response:
                        if response.status != 200:
                            errors += 1
                            if errors == 1:
                                print(f"{url}: HTTP {response.status} "
                                      f"{(await response.read())[:300]!r}", flush=True)
                            else:
                                await response.read()
                            continue
                        async for line in response.content:
                            if not line.startswith(b"data: {"):
                                continue
                            if first is None:
                                now = time.perf_counter()
                                first = now - started
                                if request == 0:
                                    stream_started()
                                stamps = STAMPS.search(line)
                                if stamps:
                                    arrived, sent = (int(t) / 1e9 for t in stamps.groups())
                                    legs.append((arrived - started, sent - arrived, now - sent))
                            if b'"choices":[]' not in line:
                                counted += 1
                except aiohttp.ClientError:
                    errors += 1
                finally:
                    if request == 0 and first is None:  # failed: it counts as started
                        stream_started()
                if first is not None:
                    ttfts.append(first)

        started, busy = time.perf_counter(), machine_busy_seconds()
        await asyncio.gather(*(one() for _ in range(streams)))
        seconds = time.perf_counter() - started
    burst_seconds = burst[0] - started if burst else 0.0
    return Run(ttfts, counted, seconds, errors, burst_seconds,
               burst[1] - busy if burst else 0.0, legs)


# A stamped first event's id: when the engine had the request and when it sent the event
# (time.perf_counter_ns: CLOCK_MONOTONIC, the clock this process's perf_counter reads too).
STAMPS = re.compile(rb'"id":"fake-(\d+)-(\d+)"')


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent on anything but idling, every core."""
    import psutil

    times = psutil.cpu_times()  # (guest time is counted in user time already)
    return float(sum(getattr(times, name, 0.0)
                     for name in ("user", "nice", "system", "irq", "softirq")))
