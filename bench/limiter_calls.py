"""CPU per rate-limit call in Redis: the limiter's script run by redis-py's asyncio client
(a blocking pool, as serving/redis_clients.py builds it, with hiredis parsing where it is
installed) and by the project's own client (serving/redis_script.py: one pipelined
connection, hiredis), in interleaved rounds (A, B, A, B), one call at a time and 16 at
once. The figure is this process's CPU time (user + system) per call: what a gateway
process spends per rate-limited request on each check, and again on each charge.
With --burst N, also how long N checks issued at once (a burst of requests at a gateway
whose limits are in Redis) wait for their replies on the project's client, the median
reply's and the last's, and Redis's own time per script call (its INFO commandstats,
read before and after).

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

from serving.ratelimit import SCRIPT  # noqa: E402
from serving.redis_clients import for_event_loop  # noqa: E402
from serving.redis_script import ScriptClient  # noqa: E402

Call = Callable[[list[str], list[str]], Awaitable[Any]]
ARGS = ["admit", "0.0006", "1.0", "0.00003", "10.0"]  # a request: 1 of 1,666, 10 tokens


async def cpu_per_call(call: Call, keys: list[str], calls: int, concurrency: int) -> float:
    """Microseconds of this process's CPU per call, `concurrency` calls in flight."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await call(keys, ARGS)

    started = time.process_time()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    return (time.process_time() - started) / calls * 1e6


async def burst_wait(call: Call, keys: list[str], size: int, bursts: int
                     ) -> tuple[float, float]:
    """Milliseconds from a burst's start until its median reply and its last (medians over
    `bursts` bursts), `size` checks issued at once."""
    async def check(started: float) -> float:
        await call(keys, ARGS)
        return time.perf_counter() - started

    medians, lasts = [], []
    for _ in range(bursts):
        started = time.perf_counter()
        replies = sorted(await asyncio.gather(*(check(started) for _ in range(size))))
        medians.append(replies[len(replies) // 2])
        lasts.append(replies[-1])
    return statistics.median(medians) * 1e3, statistics.median(lasts) * 1e3


async def script_time(pooled: Any) -> tuple[float, float]:
    """Redis's count of script calls (EVALSHA) and the microseconds it spent in them."""
    stats = (await pooled.info("commandstats")).get("cmdstat_evalsha", {})
    return float(stats.get("calls", 0)), float(stats.get("usec", 0))


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
        calls_before, usec_before = await script_time(pooled)
        median, last = await burst_wait(own.run, keys, options.burst, 20)
        calls_after, usec_after = await script_time(pooled)
        per_call = (usec_after - usec_before) / max(1.0, calls_after - calls_before)
        print(f"{options.burst} checks at once (own client, medians of 20 bursts): the "
              f"median reply {median:.2f} ms and the last {last:.2f} ms after the burst's "
              f"start; Redis's own time {per_call:.1f} us per script call", flush=True)
    await pooled.delete(*keys)
    await pooled.aclose()
    await own.close()
    one = {name: totals[name, 1] / options.rounds for name in clients}
    many = {name: totals[name, 16] / options.rounds for name in clients}
    print(f"CPU per rate-limit call, redis-py -> own client: {one['redis-py']:.1f} -> "
          f"{one['own client']:.1f} us one at a time, {many['redis-py']:.1f} -> "
          f"{many['own client']:.1f} us 16 at once ({options.rounds} interleaved rounds of "
          f"{options.calls} calls)")


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
