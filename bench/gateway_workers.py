"""Gateway throughput through `manage.py serve --workers N`: the same load sent straight to
a FAKE engine (fakes/engine.py) and through servers with 1 and with N gateway worker
processes, in interleaved rounds (direct, 1, N, direct, 1, N ...), in one run.

Each server is the product itself (controllers in its parent process) with the engine
registered as an external deployment and REDIS_URL on a private `redis-server` (more than
one worker requires it; the one-worker server gets it too, so the two differ only in the
worker count), plus, for reference, the embedded default (one process, no Redis). The
loads are gateway_overhead.py's (its load client, bench/stream_load.py, and engines,
bench/planes.py): unpaced 64
streams of 1024 tokens (--tokens), and paced (10 ms/token) 128 streams of 256. Printed
per load and server: tokens per second, the ratio to direct, TTFT p50, and the CPU time
per relayed event of the server's processes together (parent and workers). Everything
runs on this machine: engine, servers and load client share its cores.

    .venv/bin/python bench/gateway_workers.py [--workers N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.path_figures import Side  # noqa: E402
from bench.planes import ControlPlane, start_engine, wait_routed_by_every_worker  # noqa: E402
from bench.stream_load import load  # noqa: E402
from tests.services import private_redis  # noqa: E402


class Server(ControlPlane):
    """The control plane; its CPU counts every process of its tree (the workers too)."""

    def __init__(self, label: str, **extra_env: str) -> None:
        self.label = label
        super().__init__(**extra_env)

    def cpu_seconds(self) -> float:
        import psutil

        parent = psutil.Process(self.process.pid)
        total = 0.0
        for process in (parent, *parent.children(recursive=True)):
            try:
                times = process.cpu_times()
            except psutil.Error:  # a helper that has just ended
                continue
            total += times.user + times.system + times.children_user + times.children_system
        return total


    def route(self, name: str, engine_url: str) -> None:
        """Route the engine, and wait until every worker routes it."""
        super().route(name, engine_url)
        wait_routed_by_every_worker(self, name)


def measure(label: str, direct_url: str, servers: list[Server], model: str, streams: int,
            tokens: int, rounds: int) -> list[str]:
    """Interleaved rounds of one load; one printed line per path."""
    for server in servers:  # warm connection pools at the measured concurrency
        asyncio.run(load(server.url, model, streams, 8, server.key, 1))
    asyncio.run(load(direct_url, model, streams, 8, None, 1))
    direct = Side([], 0.0)
    sides = [Side([], 0.0) for _ in servers]
    for _ in range(rounds):
        direct.runs.append(asyncio.run(load(direct_url, model, streams, tokens, None, 1)))
        for server, side in zip(servers, sides, strict=True):
            before = server.cpu_seconds()
            side.runs.append(asyncio.run(load(server.url, model, streams, tokens,
                                              server.key, 1)))
            side.cpu += server.cpu_seconds() - before
    lines = [f"{label}, {streams} streams x {tokens} tokens, {rounds} rounds: direct "
             f"{direct.rate:,.0f} tok/s, TTFT p50 {direct.ttft_p50():.1f} ms"]
    for server, side in zip(servers, sides, strict=True):
        errors = sum(run.errors for run in side.runs)
        lines.append(f"  {server.label}: {side.rate:,.0f} tok/s, ratio "
                     f"{side.rate / direct.rate:.3f}, TTFT p50 {side.ttft_p50():.1f} ms "
                     f"(added {side.ttft_p50() - direct.ttft_p50():+.1f}), "
                     f"{side.cpu_per_event_us:.1f} us CPU/event, errors {errors}")
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024,
                        help="tokens per unpaced stream (a round of 64 x 1024 tokens lasts "
                             "about a second here; shorter ones measure start-up)")
    parser.add_argument("--quick", action="store_true", help="the unpaced load only")
    options = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; engine, servers and load client share them",
          flush=True)
    processes = []
    servers: list[Server] = []
    summary: list[str] = []
    with private_redis() as redis_server:
        try:
            unpaced, unpaced_url = start_engine(0.0, "fast")
            paced, paced_url = start_engine(10.0, "fake")
            processes += [unpaced, paced]
            servers.append(Server("embedded, 1 process, no Redis"))
            # A Redis database each: the route table's key is the same name in both.
            base = redis_server.url.rsplit("/", 1)[0]
            servers.append(Server("1 worker, Redis", REDIS_URL=f"{base}/1",
                                  GATEWAY_WORKERS="1"))
            servers.append(Server(f"{options.workers} workers, Redis",
                                  REDIS_URL=f"{base}/2",
                                  GATEWAY_WORKERS=str(options.workers)))
            for server in servers:
                server.route("fast", unpaced_url)
                server.route("fake", paced_url)
            loads = [("unpaced", "fast", 64, options.tokens, unpaced_url)]
            if not options.quick:
                loads.append(("paced 10 ms/token", "fake", 128, 256, paced_url))
            for label, model, streams, tokens, url in loads:
                summary += measure(label, url, servers, model, streams, tokens,
                                   options.rounds)[1:]
        finally:
            for server in servers:
                server.stop()
            for process in processes:
                process.kill()
    print("gateway workers: " + "; ".join(line.strip() for line in summary))


if __name__ == "__main__":
    main()
