"""CPU per rate-limit call in Redis: the limiter's script run by redis-py's asyncio client
(a blocking pool, as serving/redis_clients.py builds it, with hiredis parsing where it is
installed) and by the project's own client (serving/redis_script.py: one pipelined
connection, hiredis), in interleaved rounds (A, B, A, B), one call at a time and 16 at
once. The figure is this process's CPU time (user + system) per call: what a gateway
process spends per rate-limited request on each check, and again on each charge.
With --burst N, also N checks issued at once through the limiter (a burst of requests at
a gateway whose limits are in Redis), each check its own script call and the checks of
one turn of the event loop in one call (serving/ratelimit.py's RedisLimiter as it runs),
in interleaved bursts: how long they wait for their replies (the median reply's and the
last's), this process's CPU per check and Redis's own time per check (its INFO
commandstats, read around each burst).

    .venv/bin/python bench/limiter_calls.py [--calls 2000] [--rounds 4] [--burst N]
        [--redis URL]

Needs a Redis server (default: redis://127.0.0.1:6379/5, buckets under a key prefix of
its own, removed at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.ratelimit import REDIS_PREFIX, SCRIPT, Limit, RedisLimiter  # noqa: E402
from serving.redis_clients import for_event_loop  # noqa: E402
from serving.redis_script import ScriptClient  # noqa: E402

Call = Callable[[list[str], list[str]], Awaitable[Any]]
# A request: 1 of 100,000 a minute and 10 tokens of 2,000,000 (one check of two buckets).
ARGS = ["admit", "2", "0.0006", "1.0", "0.00003", "10.0"]


async def cpu_per_call(call: Call, keys: list[str], calls: int, concurrency: int) -> float:
    """Microseconds of this process's CPU per call, `concurrency` calls in flight."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await call(keys, ARGS)

    started = time.process_time()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    return (time.process_time() - started) / calls * 1e6


async def one_burst(limiter: RedisLimiter, limits: list[Limit], size: int
                    ) -> tuple[list[float], float]:
    """Seconds from the burst's start until each reply, sorted, and this process's CPU
    seconds for the burst (`size` checks issued at once)."""
    async def check(started: float) -> float:
        await limiter.admit(limits)
        return time.perf_counter() - started

    cpu = time.process_time()
    started = time.perf_counter()
    replies = sorted(await asyncio.gather(*(check(started) for _ in range(size))))
    return replies, time.process_time() - cpu


async def script_time(pooled: Any) -> float:
    """The microseconds Redis has spent in script calls (EVALSHA)."""
    stats = (await pooled.info("commandstats")).get("cmdstat_evalsha", {})
    return float(stats.get("usec", 0))


async def main(options: argparse.Namespace) -> None:
    prefix = f"bench:limiter:{uuid.uuid4().hex}:"
    keys = [prefix + "rpm", prefix + "tpm"]
    pooled = for_event_loop(options.redis)
    script = pooled.register_script(SCRIPT)
    own = ScriptClient(options.redis, SCRIPT)

    async def redis_py(keys: list[str], args: list[str]) -> Any:
        return await script(keys=keys, args=args)

    clients: dict[str, Call] = {"redis-py": redis_py, "own client": own.run}
    for call in clients.values():  # warm: connections open, the script loaded
        await cpu_per_call(call, keys, 200, 16)
    totals = {(name, c): 0.0 for name in clients for c in (1, 16)}
    for _ in range(options.rounds):
        for concurrency in (1, 16):
            for name, call in clients.items():
                totals[name, concurrency] += await cpu_per_call(call, keys, options.calls,
                                                                concurrency)
    for concurrency in (1, 16):
        figures = {name: totals[name, concurrency] / options.rounds for name in clients}
        print(f"{concurrency} call(s) at once: " + ", ".join(
            f"{name} {us:.1f} us CPU per call" for name, us in figures.items())
              + f" (ratio {figures['own client'] / figures['redis-py']:.2f})", flush=True)
    if options.burst:
        await burst_figures(options, pooled, prefix)
    await pooled.delete(*keys)
    await pooled.aclose()
    await own.close()
    one = {name: totals[name, 1] / options.rounds for name in clients}
    many = {name: totals[name, 16] / options.rounds for name in clients}
    print(f"CPU per rate-limit call, redis-py -> own client: {one['redis-py']:.1f} -> "
          f"{one['own client']:.1f} us one at a time, {many['redis-py']:.1f} -> "
          f"{many['own client']:.1f} us 16 at once ({options.rounds} interleaved rounds of "
          f"{options.calls} calls)")


async def burst_figures(options: argparse.Namespace, pooled: Any, prefix: str) -> None:
    """--burst N: each check its own script call against the checks of one turn in one
    call, 20 bursts each, interleaved."""
    limits = [Limit("requests", prefix + "burst:rpm", 100_000, 1),
              Limit("tokens", prefix + "burst:tpm", 2_000_000, 10)]
    ways = {"one call per check": RedisLimiter(options.redis, most_per_call=1),
            "one call per turn": RedisLimiter(options.redis)}
    for limiter in ways.values():
        await one_burst(limiter, limits, options.burst)  # warm: connected, script loaded
    found: dict[str, dict[str, list[float]]] = {
        name: {"median": [], "last": [], "cpu": [], "redis": []} for name in ways}
    for _ in range(20):
        for name, limiter in ways.items():
            usec_before = await script_time(pooled)
            replies, cpu = await one_burst(limiter, limits, options.burst)
            usec_after = await script_time(pooled)
            figures = found[name]
            figures["median"].append(replies[len(replies) // 2] * 1e3)
            figures["last"].append(replies[-1] * 1e3)
            figures["cpu"].append(cpu / options.burst * 1e6)
            figures["redis"].append((usec_after - usec_before) / options.burst)
    for limiter in ways.values():
        await limiter.close()
    await pooled.delete(*(REDIS_PREFIX + limit.bucket for limit in limits))
    for name, figures in found.items():
        median = {what: statistics.median(values) for what, values in figures.items()}
        print(f"{options.burst} checks at once, {name} (medians of 20 interleaved "
              f"bursts): the median reply {median['median']:.2f} ms and the last "
              f"{median['last']:.2f} ms after the burst's start; {median['cpu']:.1f} us "
              f"of this process's CPU and {median['redis']:.1f} us of Redis's per check",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="also N checks issued at once: how long they wait")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/5")
    options = parser.parse_args()
    if options.burst < 0:
        parser.error("--burst takes 0 (none) or more checks")
    import uvloop

    uvloop.run(main(options))
