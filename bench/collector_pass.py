"""Collector cost: one metrics pass over 500 replicas.

One FAKE engine process (fakes/engine.py) listens on 500 ports, each registered as a ready
replica (125 external deployments of 4), each port with its own counters; the collector
(controlplane/collector.py) scrapes them all every 2 s, as it does in the product: the
database query for live replicas, 500 HTTP GETs of /metrics at once, parsing what changed,
the ring buffers and the pushes to the dashboards' channel groups. A load process sends
requests meanwhile: to a tenth of the replicas each interval, or to all of them (every
exposition changes, every one is parsed), the two loads alternating round by round.

    .venv/bin/python bench/collector_pass.py [--replicas 500] [--passes 10] [--rounds 2]

Prints the median pass time in both cases; the target is under 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--traffic":
        run_traffic(sys.argv[2], float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=500)
    parser.add_argument("--passes", type=int, default=10, help="per load, over the rounds")
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="collector-bench-"))
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS"):
        os.environ.pop(name, None)  # development defaults: SQLite, in-memory layer
    os.environ.update({"DEBUG": "true", "DATA_DIR": str(data), "LOG_LEVEL": "WARNING",
                       "SCRAPE_INTERVAL": "2", "SCRAPE_TIMEOUT": "1.5"})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    ports_file = data / "ports"
    engine = subprocess.Popen(
        [sys.executable, "-m", "fakes.engine", "--port", "0", "--model", "fake",
         "--token-interval-ms", "1", "--extra-ports", str(options.replicas - 1),
         "--ports-file", str(ports_file)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (ports_file.exists() and len(ports_file.read_text().split()) ==
                   options.replicas):
            if time.monotonic() > deadline or engine.poll() is not None:
                raise SystemExit("the fake engine did not start")
            time.sleep(0.2)
        time.sleep(1)
        ports = [int(p) for p in ports_file.read_text().split()]
        register(ports)
        times: dict[str, list[float]] = {"a tenth busy": [], "all busy": []}
        # The two loads alternate round by round (a tenth, all, a tenth, all ...), so both
        # see the same machine.
        for _ in range(options.rounds):
            for label, fraction in (("a tenth busy", 0.1), ("all busy", 1.0)):
                load = subprocess.Popen([sys.executable, __file__, "--traffic",
                                         str(ports_file), str(fraction)], cwd=ROOT)
                try:
                    time.sleep(4)  # the first round of requests lands
                    times[label] += asyncio.run(measure(ports, options.passes //
                                                        options.rounds, label))
                finally:
                    load.kill()
        results = {label: statistics.median(values) for label, values in times.items()}
    finally:
        engine.kill()
    print(f"collector pass over {options.replicas} replicas: median "
          f"{results['a tenth busy'] * 1000:.0f} ms with a tenth of them serving, "
          f"{results['all busy'] * 1000:.0f} ms with all serving (target: under 500 ms)")


def register(ports: list[int]) -> None:
    from controlplane.models import Backend, Deployment, Replica
    from models_registry.models import Model

    backend = Backend.objects.create(name="bench", kind="external",
                                     config={"url": f"http://127.0.0.1:{ports[0]}"})
    model = Model.objects.create(name="bench-model", source="huggingface",
                                 source_uri="bench/model", status="ready")
    for start in range(0, len(ports), 4):
        deployment = Deployment.objects.create(name=f"bench-{start // 4}", model=model,
                                               backend=backend, replicas=4)
        Replica.objects.bulk_create(
            Replica(deployment=deployment, name=f"bench-{start // 4}-{n}",
                    endpoint=f"http://127.0.0.1:{port}", phase=Replica.Phase.READY)
            for n, port in enumerate(ports[start:start + 4]))


async def traffic(ports: list[int], fraction: float) -> None:
    """Every 2 s, one request to `fraction` of the replicas (in turn), spread over the 2 s:
    their counters and histograms move, the others' stay as they were."""
    from serving.upstream import ConnectionPool

    pool = ConnectionPool()
    body = b'{"model": "fake", "prompt": "hi", "max_tokens": 4}'
    per_round = max(1, int(len(ports) * fraction))
    batches = max(1, per_round // 25)

    async def one(port: int) -> None:
        response = await pool.request("POST", f"http://127.0.0.1:{port}", "/v1/completions",
                                      body, (("Content-Type", "application/json"),))
        await response.read()
        response.release()

    index = 0
    while True:
        started = time.monotonic()
        for batch in range(batches):
            size = per_round // batches + (1 if batch < per_round % batches else 0)
            await asyncio.gather(*(one(ports[(index + n) % len(ports)]) for n in range(size)))
            index += size
            await asyncio.sleep(max(0.0, started + 1.8 * (batch + 1) / batches
                                    - time.monotonic()))
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - started)))


def run_traffic(ports_file: str, fraction: float) -> None:
    ports = [int(p) for p in Path(ports_file).read_text().split()]
    asyncio.run(traffic(ports, fraction))


async def measure(ports: list[int], passes: int, label: str) -> list[float]:
    from controlplane.collector import Collector

    collector = Collector(interval=2.0)
    times = []
    await collector.one_pass()  # connections opened once, as in a running product
    for _ in range(passes):
        started = time.monotonic()
        result = await collector.one_pass()
        times.append(result["seconds"])
        print(f"{label}: {result['targets']} replicas, {result['scraped']} scraped, "
              f"{result['parsed']} parsed (changed), {result['seconds'] * 1000:.0f} ms",
              flush=True)
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
    collector.close()
    return times


if __name__ == "__main__":
    main()
