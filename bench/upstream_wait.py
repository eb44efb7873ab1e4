"""How long a request of a burst waits between its arrival at the gateway and its write
to the replica, with the rate limits in memory (the embedded default, `make run`) and in
Redis (the gateway alone, `serve --no-controllers` beside `run_controllers`, on a private
`redis-server`), in interleaved rounds (A, B, A, B) of 128 streams paced at 10 ms a token
before one fake engine. The wait is the usage records' `queue_ms` (from the request's
arrival, its key known, to the upstream write), read from each server's database after
the rounds; the TTFT p50 each path's client saw is printed beside it.

    .venv/bin/python bench/upstream_wait.py [--rounds 4] [--streams 128]  # about 1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planes import ControlPlane, GatewayOnly, start_engine  # noqa: E402
from bench.stream_load import load  # noqa: E402
from bench.usage_waits import after_records, now_as_stored, wait_for_records  # noqa: E402
from tests.services import private_redis  # noqa: E402

TOKENS = 64  # per stream: the burst is what is measured, not the stream's length


def main(options: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        redis_server = stack.enter_context(private_redis())
        paths = {"limits in memory (embedded)": ControlPlane(),
                 "limits in Redis (gateway alone)": GatewayOnly(
                     redis_server.database_url(0))}
        for plane in paths.values():
            stack.callback(plane.stop)
        engine, url = start_engine(10.0, "fake")
        stack.callback(engine.kill)
        warmed = now_as_stored()
        for plane in paths.values():
            plane.route("fake", url)
            asyncio.run(load(plane.url, "fake", 8, 16, plane.key, 1))  # warm
        since = after_records((plane.database for plane in paths.values()), warmed, 8)
        ttft: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(options.rounds):
            for name, plane in paths.items():
                run = asyncio.run(load(plane.url, "fake", options.streams, TOKENS,
                                       plane.key, 1))
                if run.errors:
                    sys.exit(f"{name}: {run.errors} requests failed")
                ttft[name].append(run.p(0.5))
        expected = options.rounds * options.streams
        medians = []
        for name, plane in paths.items():
            waits = sorted(wait_for_records(plane.database, since, expected))
            if len(waits) != expected:  # fewer: not written; more: not this run's alone
                sys.exit(f"{name}: {len(waits)} usage records, not {expected}")
            medians.append(statistics.median(waits))
            print(f"{name}: arrival to upstream write median {medians[-1]:.2f} "
                  f"ms, p90 {waits[int(0.9 * len(waits))]:.2f} ms ({len(waits)} requests); "
                  f"TTFT p50 {statistics.median(ttft[name]):.1f} ms (median of "
                  f"{options.rounds} rounds)", flush=True)
        print(f"arrival to upstream write, median, {options.streams} paced streams: limits in "
              f"memory {medians[0]:.2f} ms, in Redis {medians[1]:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=128)
    arguments = parser.parse_args()
    if arguments.rounds < 1 or arguments.streams < 1:
        parser.error("--rounds and --streams take 1 or more")
    main(arguments)
