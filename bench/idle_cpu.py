"""Idle CPU of the control plane: `manage.py serve` as `make run` starts it (the embedded
default: gateway, controllers and collector in one process, the development settings,
SQLite), its deployments ready, no traffic at all. The figure is the serve process's
user + system CPU time over a window (psutil), as a percentage of one core; the CPU of the
replicas themselves is not counted. Each case prints a per-thread breakdown (psutil's
per-thread times; the thread whose id is the process id runs the event loop, the others are
worker threads of `asyncio.to_thread`, the usage writer, the metrics parser's helpers...).

Replicas are FAKE engines by default (fakes/engine.py started by the local backend through
fakes/vllm_cli.stand_in_python: a real process per replica, a real /metrics to scrape);
`--vllm` runs the demo deployment itself as `make run` does (import_demo_model,
ensure_demo_deployment: one real vLLM CPU replica, a minute or two to be ready) and adds
fake deployments beside it for the three-deployment case.

With `--relay` it also measures whether the controllers' threads hurt the relay: the same
paced load (the fake engine, 10 ms/token, 128 streams) sent in interleaved rounds to
`serve` (embedded) and to `serve --no-controllers` with `run_controllers` in a separate
process, both over the same replicas, comparing added TTFT p50 and CPU per relayed event
of the gateway process.

    .venv/bin/python bench/idle_cpu.py [--seconds 60] [--vllm] [--relay]

The last line is the worst idle figure against the target (under 3% of one core).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fakes.vllm_cli import stand_in_python  # noqa: E402
from tests.processes import (  # noqa: E402
    Api,
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
)

TARGET_PERCENT = 3.0


@dataclass
class Plane:
    """One running control plane: its serve process, the API, its environment."""

    api: Api
    env: dict[str, str]
    process: subprocess.Popen[str]
    python: str
    extra: list[subprocess.Popen[str]] = field(default_factory=list)

    def stop(self) -> None:
        for process in [*self.extra, self.process]:
            stop_server(process)
        end_replicas(self.env["DATA_DIR"])


def start_plane(folder: Path, *, vllm: bool, controllers_apart: bool = False,
                env: dict[str, str] | None = None) -> Plane:
    """`manage.py serve` with a fake-engine local backend (`fakes`) and a model `fake`;
    with `vllm`, also the demo model and deployment as `make run` creates them."""
    env = env if env is not None else prepared_env(folder, vllm=vllm)
    key = manage(env, "create_api_key", "--name", f"bench-{time.monotonic_ns()}", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    port = free_port()
    options = ("--no-controllers",) if controllers_apart else ()
    process, _ = start_server(env, port, *options)
    plane = Plane(Api(f"http://127.0.0.1:{port}", key), env, process,
                  env["LOCAL_BACKEND_PYTHONS"])
    if controllers_apart:
        plane.extra.append(subprocess.Popen(
            [sys.executable, "manage.py", "run_controllers"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
    return plane


def prepared_env(folder: Path, *, vllm: bool, **extra: str) -> dict[str, str]:
    """A migrated data folder with the model `fake` (and with `vllm` the demo model and
    deployment, as `make run` creates them); the environment `make run` gives `serve`."""
    python = stand_in_python(folder, token_interval_ms=10.0)
    env = server_env(folder / "data", LOG_LEVEL="WARNING", LOCAL_BACKEND_PYTHONS=python,
                     **extra)
    manage(env, "migrate", "--noinput", "-v0")
    weights = folder / "weights"
    weights.mkdir()
    manage(env, "shell", "-c", "from tests.factories import make_model; "
                               f"make_model('fake', path={str(weights)!r})")
    if vllm:
        manage(env, "import_demo_model")
        manage(env, "ensure_demo_deployment")
    return env


def add_fake_deployment(plane: Plane, name: str) -> None:
    if not any(b["name"] == "fakes" for b in results(plane.api.get("/api/v1/backends/"))):
        created = plane.api.post("/api/v1/backends/", {"name": "fakes", "kind": "local",
                                                       "config": {"python": plane.python}})
        if created.status_code != 201:
            raise SystemExit(f"backend: {created.status_code} {created.text}")
    created = plane.api.post("/api/v1/deployments/", {
        "name": name, "model": "fake", "backend": "fakes", "replicas": 1,
        "engine_args": {"served_model_name": name}})
    if created.status_code != 201:
        raise SystemExit(f"deployment {name}: {created.status_code} {created.text}")


def results(page: object) -> list[dict[str, object]]:
    return list(page["results"] if isinstance(page, dict) else page)  # type: ignore[arg-type]


def wait_ready(plane: Plane, names: list[str], timeout: float) -> None:
    def check() -> bool:
        models = httpx.get(f"{plane.api.url}/v1/models", timeout=5,
                           headers={"Authorization": f"Bearer {plane.api.key}"}).json()
        ready = {m["id"] for m in models["data"] if m.get("ready_replicas")}
        return set(names) <= ready

    plane.api.wait_for(f"{names} ready", check, timeout, 0.5)


def helpers_of(pid: int) -> list[psutil.Process]:
    """The serve process's own child processes (the metrics parser), not its replicas
    (whose environment carries the local backend's replica marker)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "FLEETPLANE_REPLICA" not in child.environ():
                found.append(child)
        except psutil.Error:
            continue
    return found


def cpu_of(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def measure(pid: int, seconds: float) -> tuple[float, float, dict[int, float]]:
    """% of one core used over `seconds` by process `pid`, by its helper processes, and
    per thread id of `pid`."""
    process = psutil.Process(pid)
    helpers = helpers_of(pid)
    before_threads = {t.id: t.user_time + t.system_time for t in process.threads()}
    before, before_helpers = cpu_of([process]), cpu_of(helpers)
    started = time.monotonic()
    time.sleep(seconds)  # the measurement window itself: nothing to wait for
    after, after_helpers = cpu_of([process]), cpu_of(helpers)
    elapsed = time.monotonic() - started
    after_threads = {t.id: t.user_time + t.system_time for t in process.threads()}
    threads = {tid: (spent - before_threads.get(tid, 0.0)) / elapsed * 100
               for tid, spent in after_threads.items()}
    return ((after - before) / elapsed * 100, (after_helpers - before_helpers) / elapsed * 100,
            threads)


def report(label: str, pid: int, seconds: float) -> float:
    # Let the start-up settle (first passes, imports, connection pools) before measuring.
    time.sleep(min(10.0, seconds / 3))
    serve, helpers, threads = measure(pid, seconds)
    total = serve + helpers
    print(f"{label}: {total:.2f}% of one core over {seconds:.0f} s (serve {serve:.2f}%, "
          f"its helper processes {helpers:.2f}%)", flush=True)
    for tid, percent in sorted(threads.items(), key=lambda item: -item[1])[:6]:
        name = "event loop (main thread)" if tid == pid else f"thread {tid}"
        print(f"    {name}: {percent:.2f}%", flush=True)
    return total


def idle_cases(options: argparse.Namespace) -> list[tuple[str, float]]:
    folder = Path(tempfile.mkdtemp(prefix="idle-cpu-bench-"))
    plane = start_plane(folder, vllm=options.vllm)
    figures = []
    try:
        first = ["smollm2"] if options.vllm else ["idle-1"]
        if not options.vllm:
            add_fake_deployment(plane, "idle-1")
        wait_ready(plane, first, 600 if options.vllm else 120)
        kind = "the demo deployment (real vLLM)" if options.vllm else "1 fake deployment"
        figures.append((kind, report(f"idle, {kind}", plane.process.pid, options.seconds)))
        more = ["idle-2", "idle-3"]
        for name in more:
            add_fake_deployment(plane, name)
        wait_ready(plane, [*first, *more], 120)
        label = f"3 deployments ({kind} + 2 fake)" if options.vllm else "3 fake deployments"
        figures.append((label, report(f"idle, {label}", plane.process.pid, options.seconds)))
    finally:
        plane.stop()
    return figures


def relay_comparison(options: argparse.Namespace) -> None:
    """Embedded `serve` against `serve --no-controllers` beside `run_controllers`: two
    planes, each with one fake replica (10 ms/token) and its own database, the same private
    Redis (the split layout needs it for the route table; the embedded one is given it too,
    so that only the process layout differs); rounds interleaved, direct first."""
    from bench.gateway_overhead import load
    from tests.services import PrivateRedis

    redis = PrivateRedis(free_port(), Path(tempfile.mkdtemp(prefix="idle-cpu-redis-")))
    redis.start()
    planes: dict[str, Plane] = {}
    try:
        for index, (name, apart) in enumerate((("embedded", False), ("controllers apart", True))):
            folder = Path(tempfile.mkdtemp(prefix="relay-bench-"))
            url = f"redis://127.0.0.1:{redis.port}/{index + 1}"
            env = prepared_env(folder, vllm=False, REDIS_URL=url)
            planes[name] = start_plane(folder, vllm=False, controllers_apart=apart, env=env)
            add_fake_deployment(planes[name], "relay")
            wait_ready(planes[name], ["relay"], 120)
        replica = next(r for r in planes["embedded"].api.get(
            "/api/v1/deployments/relay/")["replica_list"] if r["phase"] == "ready")
        engine = str(replica["endpoint"])
        streams, tokens = options.relay_streams, 128
        cpu = {name: 0.0 for name in planes}
        events = {name: 0 for name in planes}
        ttfts: dict[str, list[float]] = {name: [] for name in planes}
        direct: list[float] = []
        for plane in planes.values():  # warm connection pools at this concurrency
            asyncio.run(load(plane.api.url, "relay", streams, 8, plane.api.key, 1))
        for _ in range(options.relay_rounds):
            direct += asyncio.run(load(engine, "relay", streams, tokens, None, 1)).ttfts
            for name, plane in planes.items():
                process = psutil.Process(plane.process.pid)
                before = sum(process.cpu_times()[:2])
                run = asyncio.run(load(plane.api.url, "relay", streams, tokens,
                                       plane.api.key, 1))
                cpu[name] += sum(process.cpu_times()[:2]) - before
                events[name] += run.tokens
                ttfts[name] += run.ttfts
        for name in planes:
            print(f"relay, {streams} streams x {tokens} tokens at 10 ms/token, "
                  f"{options.relay_rounds} interleaved rounds, {name}: added TTFT p50 "
                  f"{percentile(ttfts[name], 0.5) - percentile(direct, 0.5):+.2f} ms, p99 "
                  f"{percentile(ttfts[name], 0.99) - percentile(direct, 0.99):+.2f} ms, "
                  f"{cpu[name] / max(1, events[name]) * 1e6:.1f} us CPU of the gateway "
                  f"process per event", flush=True)
    finally:
        for plane in planes.values():
            plane.stop()
        redis.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    parser.add_argument("--vllm", action="store_true", help="the real demo deployment")
    parser.add_argument("--relay", action="store_true", help="also compare the relay of "
                        "serve (embedded) with serve --no-controllers + run_controllers")
    parser.add_argument("--relay-rounds", type=int, default=4)
    parser.add_argument("--relay-streams", type=int, default=128)
    parser.add_argument("--relay-only", action="store_true", help="skip the idle cases")
    options = parser.parse_args()
    if options.relay or options.relay_only:
        relay_comparison(options)
    if options.relay_only:
        return
    figures = idle_cases(options)
    worst_label, worst = max(figures, key=lambda item: item[1])
    verdict = "met" if worst < TARGET_PERCENT else "missed"
    print(f"idle CPU of serve: {'; '.join(f'{label} {value:.2f}%' for label, value in figures)}"
          f" | worst {worst:.2f}% of one core ({worst_label}) against the target of under "
          f"{TARGET_PERCENT:.0f}%: {verdict}")


if __name__ == "__main__":
    main()
