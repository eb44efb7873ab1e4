"""Two calls the idle control plane makes for a fleet, old way against new, in interleaved
rounds (A, B, A, B), CPU time of this process per call:

- which of 1,000 dashboard groups have a socket: a redis-py pipeline of 1,000 `EXISTS`
  against one Lua call over the same keys (controlplane/metrics/publishing.py:watched);
- a health probe of an endpoint that answers and of one that refuses: httpx's pooled
  client against the project's probe client (controlplane/backends/probe_client.py).

Needs the local Redis (127.0.0.1:6379, database 14, keys only read). Starts one FAKE
engine (fakes/engine.py) for the answering endpoint.

    .venv/bin/python bench/probe_calls.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.backends.probe_client import ProbeClient, ProbeFailed  # noqa: E402
from controlplane.metrics.publishing import _EXISTING  # noqa: E402
from tests.processes import free_port  # noqa: E402


def cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


async def groups(rounds: int) -> list[str]:
    import redis.asyncio as redis

    client = redis.Redis.from_url("redis://127.0.0.1:6379/14")
    keys = [f"asgi:group:dashboard.deployment.fleet-{i:05d}".encode() for i in range(1000)]
    spent = {"pipeline": 0.0, "lua": 0.0}
    try:
        for _ in range(rounds):
            for name in spent:
                started = cpu()
                for _ in range(20):
                    if name == "pipeline":
                        pipe = client.pipeline(transaction=False)
                        for key in keys:
                            pipe.exists(key)
                        await pipe.execute()
                    else:
                        await client.eval(_EXISTING, len(keys), *keys)
                spent[name] += cpu() - started
    finally:
        await client.aclose()
    passes = 20 * rounds
    return [f"open dashboards among 1,000 groups, per pass: pipeline "
            f"{spent['pipeline'] / passes * 1000:.2f} ms, Lua {spent['lua'] / passes * 1000:.2f}"
            f" ms of CPU"]


def probes(rounds: int) -> list[str]:
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    answering, refusing = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{answering}/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the fake engine did not start"
            time.sleep(0.1)
    http = httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
    client = ProbeClient()

    def by_httpx(url: str) -> None:
        try:
            http.get(f"{url}/v1/models", timeout=5)
        except httpx.HTTPError:
            pass

    def by_probe_client(url: str) -> None:
        try:
            client.status(url, "/v1/models")
        except ProbeFailed:
            pass

    ways = {"httpx": by_httpx, "probe client": by_probe_client}
    spent = {(way, url): 0.0 for way in ways for url in (answering, refusing)}
    try:
        for _ in range(rounds):
            for url in (answering, refusing):
                for way, call in ways.items():
                    call(url)  # a connection made before the count
                    started = cpu()
                    for _ in range(400):
                        call(url)
                    spent[(way, url)] += cpu() - started
    finally:
        engine.kill()
        engine.wait(10)
    lines = []
    for url, what in ((answering, "answering"), (refusing, "refusing")):
        lines.append(f"probe of an endpoint {what}, per probe: " + ", ".join(
            f"{way} {spent[(way, url)] / (400 * rounds) * 1e6:.0f} µs" for way in ways)
            + " of CPU")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    rounds = parser.parse_args().rounds
    lines = asyncio.run(groups(rounds)) + probes(rounds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
