"""Priority admission under overload, against a FAKE engine (fakes/engine.py) behind the
real gateway (`manage.py serve`).

The engine generates at most 8 requests at once, one token every 25 ms, 16 tokens per
answer (0.4 s each: about 20 answers per second); the deployment lets the gateway send
it 8 at a time (`admission.replica_concurrency`). Batch-class traffic arrives at twice
that rate (40 streamed requests per second, open loop) while a critical-class client sends
one streamed request after another. Measured: the critical requests' time to first token
(client side, to the first content chunk), alone (unloaded), under the batch load
with the priority queue (the default classes), and under the same load with plain FIFO
(every class at one level, sharing every slot): two servers side by side before the same
engine, the three cases interleaved round by round (unloaded, priority, FIFO; again).

    .venv/bin/python bench/priority.py [--seconds 60] [--rounds 2]

Target: the critical p99 TTFT under load within 2x of its unloaded value. The last line
prints the ratio with the priority queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planes import ControlPlane  # noqa: E402
from tests.processes import free_port, manage, wait_healthy  # noqa: E402

MAX_RUNNING = 8
TOKEN_MS = 25
TOKENS = 16
BATCH_RATE = 2 * MAX_RUNNING / (TOKEN_MS * TOKENS / 1000)  # twice the capacity
FIFO = {name: {"level": 10, "max_queued": 100000, "max_wait_seconds": 600}
        for name in ("critical", "standard", "batch")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def ttft(client: httpx.AsyncClient, url: str, key: str) -> float | None:
    """Seconds to the first content chunk of a streamed completion; None if refused."""
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
            "model": "chat", "prompt": "Hello", "max_tokens": TOKENS, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
        return first


async def critical_stream(url: str, key: str, seconds: float, pause: float = 0.05
                          ) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = await ttft(client, url, key)
            if value is not None:
                out.append(value)
            await asyncio.sleep(pause)
    return out


async def loaded(url: str, batch_key: str, critical_key: str, seconds: float
                 ) -> tuple[list[float], dict[str, int]]:
    """Batch arrivals at BATCH_RATE for `seconds`; the critical stream from 5 s in."""
    counts = {"sent": 0, "answered": 0, "refused": 0}
    limits = httpx.Limits(max_connections=100_000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        pending: set[asyncio.Task[None]] = set()

        async def one() -> None:
            counts["sent"] += 1
            # Read as bytes, unparsed: the load generator shares the machine's cores.
            async with client.stream("POST", f"{url}/v1/completions", headers={
                    "Authorization": f"Bearer {batch_key}"}, json={
                    "model": "chat", "prompt": "Hello", "max_tokens": TOKENS,
                    "stream": True}) as r:
                async for _ in r.aiter_raw():
                    pass
            counts["answered" if r.status_code == 200 else "refused"] += 1

        async def arrivals() -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            n = 0
            while loop.time() - start < seconds:
                n += 1
                task = asyncio.create_task(one())
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(max(0.0, start + n / BATCH_RATE - loop.time()))

        started = time.monotonic()
        feeder = asyncio.create_task(arrivals())
        await asyncio.sleep(5)  # the queue builds up first
        critical = await critical_stream(url, critical_key, seconds - 5)
        await feeder
        counts["seconds"] = round(time.monotonic() - started)
        for task in list(pending):  # the backlog is not measured: the clients leave
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return critical, counts


def deploy(product: ControlPlane, engine_url: str) -> None:
    steps: list[tuple[str, dict[str, object]]] = [
            ("/api/v1/models/", {"name": "chat-model", "source": "huggingface",
                                 "hf_id": "bench/chat"}),
            ("/api/v1/backends/", {"name": "engine", "kind": "external",
                                   "config": {"url": engine_url}}),
            ("/api/v1/deployments/", {"name": "chat", "model": "chat-model",
                                      "backend": "engine",
                                      "engine_args": {"served_model_name": "chat"},
                                      "admission": {"replica_concurrency": MAX_RUNNING}})]
    for path, body in steps:
        product.api(path, body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        models = httpx.get(f"{product.url}/v1/models", timeout=5,
                           headers={"Authorization": f"Bearer {product.key}"}).json()
        if any(m["id"] == "chat" and m["ready_replicas"] for m in models["data"]):
            return
        time.sleep(0.5)
    raise SystemExit("the deployment did not become routable")


def keys(product: ControlPlane) -> tuple[str, str]:
    made = []
    for priority in ("batch", "critical"):
        made.append(manage(product.env, "create_api_key", "--name", priority, "--priority",
                           priority).stdout.strip().splitlines()[-1])
    return made[0], made[1]


def describe(values: list[float]) -> str:
    return (f"p50 {statistics.median(values) * 1000:.1f} ms, p99 "
            f"{percentile(values, 99) * 1000:.1f} ms ({len(values)} requests)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="loaded seconds per case, split over the rounds")
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port", str(port),
                               "--model", "chat", "--token-interval-ms", str(TOKEN_MS),
                               "--max-running", str(MAX_RUNNING)], cwd=ROOT)
    engine_url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {"unloaded": [], "priority": [], "fifo": []}
    products: dict[str, ControlPlane] = {}
    try:
        wait_healthy(engine_url, 30, engine)
        for case, classes in (("priority", None), ("fifo", FIFO)):
            extra = {"PRIORITY_CLASSES": json.dumps(classes)} if classes else {}
            products[case] = ControlPlane(**extra)
            deploy(products[case], engine_url)
        made = {case: keys(product) for case, product in products.items()}
        seconds = options.seconds / options.rounds
        # Interleaved round by round (unloaded, priority, FIFO; again), so that all three
        # see the same machine: the two servers share the engine and the cores.
        for round_number in range(1, options.rounds + 1):
            unloaded = asyncio.run(critical_stream(products["priority"].url,
                                                   made["priority"][1], 20 / options.rounds))
            results["unloaded"] += unloaded
            print(f"round {round_number}: unloaded critical TTFT: {describe(unloaded)}",
                  flush=True)
            for case, product in products.items():
                batch_key, critical_key = made[case]
                critical, counts = asyncio.run(loaded(product.url, batch_key, critical_key,
                                                      seconds))
                results[case] += critical
                print(f"round {round_number}: {case}: batch {counts['sent']} sent at "
                      f"{BATCH_RATE:.0f}/s, {counts['answered']} answered in the "
                      f"{counts['seconds']} s run ({counts['answered'] / counts['seconds']:.1f}"
                      f"/s); critical TTFT under load: {describe(critical)}", flush=True)
    finally:
        for product in products.values():
            product.stop()
        engine.terminate()
        engine.wait(timeout=10)
    for case, values in results.items():
        print(f"{case}, all rounds: critical TTFT {describe(values)}")
    base = percentile(results["unloaded"], 99)
    with_queue = percentile(results["priority"], 99)
    fifo = percentile(results["fifo"], 99)
    print(f"critical p99 TTFT: unloaded {base * 1000:.1f} ms, FIFO under load "
          f"{fifo * 1000:.1f} ms ({fifo / base:.1f}x)")
    print(f"critical p99 TTFT under 2x batch load with the priority queue: "
          f"{with_queue * 1000:.1f} ms = {with_queue / base:.2f}x unloaded (target < 2x)")


if __name__ == "__main__":
    main()
