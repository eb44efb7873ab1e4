"""Idle CPU of the control plane: `manage.py serve` as `make run` starts it (the embedded
default: gateway, controllers and collector in one process, the development settings,
SQLite), its deployments ready, no traffic at all. The figure is the serve process's
user + system CPU time over a window (psutil), plus its own helper processes' (the metrics
parser), as a percentage of one core; the replicas' processes (and their children: vLLM's
engine core and workers) are not counted. Each case prints a per-thread breakdown
(psutil's per-thread times; the thread whose id is the process id runs the event loop, the
others are mostly the worker threads of `asyncio.to_thread`: reconcile passes, the
collector's and autoscaler's database reads).

Replicas are FAKE engines by default (fakes/engine.py started by the local backend through
fakes/vllm_cli.stand_in_python: a real process per replica, a real /metrics to scrape);
`--vllm` runs the demo deployment itself as `make run` does (import_demo_model,
ensure_demo_deployment: one real vLLM CPU replica, a minute or two to be ready) and adds
fake deployments beside it for the three-deployment case.

With `--compare-with PATH` (another checkout of the project, same .venv) that checkout's
server runs beside this one and both are measured over the same windows.

With `--redis` each plane is given `REDIS_URL` (its own database of one private
`redis-server` started for the run; still SQLite): the route table, limits and
revocations in Redis, as a gateway with workers or apart from its controllers has them.

With `--relay` (or `--relay-only`) it also measures whether the controllers' threads hurt
the relay: two planes, each with one fake replica (10 ms/token) and the same private
`redis-server`: `serve` (embedded) and `serve --no-controllers` with `run_controllers` in a
separate process. 128 streams, direct to the embedded plane's replica then through each
layout (taking turns going first), in interleaved rounds: added TTFT p50/p99 and CPU per
relayed event of the gateway process.

    .venv/bin/python bench/idle_cpu.py [--seconds 60] [--vllm] [--compare-with PATH]
                                       [--redis] [--relay | --relay-only] [--relay-rounds 4]

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
    root: Path = ROOT
    extra: list[subprocess.Popen[str]] = field(default_factory=list)

    def stop(self) -> None:
        for process in [*self.extra, self.process]:
            stop_server(process)
        end_replicas(self.env["DATA_DIR"])


def run_manage(root: Path, env: dict[str, str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    """A manage.py command of the checkout at `root`."""
    if root == ROOT:
        return manage(env, *args)
    return subprocess.run([sys.executable, "manage.py", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300, check=True)


def start_serve(root: Path, env: dict[str, str], port: int,
                *options: str) -> subprocess.Popen[str]:
    """`manage.py serve` of the checkout at `root`, once it answers /healthz."""
    if root == ROOT:
        return start_server(env, port, *options)[0]
    process = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port),
                                *options], cwd=root, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, text=True)
    Api(f"http://127.0.0.1:{port}", "").wait_for(f"serve in {root}", lambda: answers(port),
                                                 60, 0.2)
    return process


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_plane(folder: Path, *, vllm: bool, controllers_apart: bool = False,
                env: dict[str, str] | None = None, root: Path = ROOT) -> Plane:
    """`manage.py serve` with a fake-engine local backend (`fakes`) and a model `fake`;
    with `vllm`, also the demo model and deployment as `make run` creates them."""
    env = env if env is not None else prepared_env(folder, vllm=vllm, root=root)
    key = run_manage(root, env, "create_api_key", "--name", f"bench-{time.monotonic_ns()}",
                     "--scope", "admin").stdout.strip().splitlines()[-1]
    port = free_port()
    options = ("--no-controllers",) if controllers_apart else ()
    process = start_serve(root, env, port, *options)
    plane = Plane(Api(f"http://127.0.0.1:{port}", key), env, process,
                  env["LOCAL_BACKEND_PYTHONS"], root)
    if controllers_apart:
        plane.extra.append(subprocess.Popen(
            [sys.executable, "manage.py", "run_controllers"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
    return plane


def prepared_env(folder: Path, *, vllm: bool, root: Path = ROOT,
                 **extra: str) -> dict[str, str]:
    """A migrated data folder with the model `fake` (and with `vllm` the demo model and
    deployment, as `make run` creates them); the environment `make run` gives `serve`."""
    python = stand_in_python(folder, token_interval_ms=10.0)
    env = server_env(folder / "data", LOG_LEVEL="WARNING", LOCAL_BACKEND_PYTHONS=python,
                     **extra)
    run_manage(root, env, "migrate", "--noinput", "-v0")
    weights = folder / "weights"
    weights.mkdir()
    run_manage(root, env, "shell", "-c", "from tests.factories import make_model; "
                                         f"make_model('fake', path={str(weights)!r})")
    if vllm:
        run_manage(root, env, "import_demo_model")
        run_manage(root, env, "ensure_demo_deployment")
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
    """The serve process's own child processes (the metrics parser), not its replicas:
    a process whose environment carries the local backend's replica marker is left out
    with everything below it (vLLM's engine core and workers do not carry it)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if "FLEETPLANE_REPLICA" not in child.environ():
                found += [child, *helpers_of(child.pid)]
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


def measure(pids: list[int], seconds: float
            ) -> list[tuple[float, float, dict[int, float]]]:
    """Per process, over the same `seconds`: % of one core used by it, by its helper
    processes, and per thread id."""
    processes = [psutil.Process(pid) for pid in pids]
    helpers = [helpers_of(pid) for pid in pids]
    before_threads = [{t.id: t.user_time + t.system_time for t in p.threads()}
                      for p in processes]
    before = [(cpu_of([p]), cpu_of(h)) for p, h in zip(processes, helpers, strict=True)]
    started = time.monotonic()
    time.sleep(seconds)  # the measurement window itself: nothing to wait for
    after = [(cpu_of([p]), cpu_of(h)) for p, h in zip(processes, helpers, strict=True)]
    elapsed = time.monotonic() - started
    out = []
    for process, was, now, threads_before in zip(processes, before, after, before_threads,
                                                 strict=True):
        threads = {t.id: (t.user_time + t.system_time - threads_before.get(t.id, 0.0))
                   / elapsed * 100 for t in process.threads()}
        out.append(((now[0] - was[0]) / elapsed * 100, (now[1] - was[1]) / elapsed * 100,
                    threads))
    return out


def report(label: str, planes: dict[str, Plane], seconds: float) -> dict[str, float]:
    """Measure every plane over the same window; print each one's figure and threads."""
    # Let the start-up settle (first passes, imports, connection pools) before measuring.
    time.sleep(min(10.0, seconds / 3))
    pids = [plane.process.pid for plane in planes.values()]
    figures = {}
    for (name, plane), (serve, helpers, threads) in zip(planes.items(), measure(pids, seconds),
                                                        strict=True):
        total = figures[name] = serve + helpers
        print(f"{label}, {name}: {total:.2f}% of one core over {seconds:.0f} s (serve "
              f"{serve:.2f}%, its helper processes {helpers:.2f}%)", flush=True)
        for tid, percent in sorted(threads.items(), key=lambda item: -item[1])[:4]:
            thread = ("event loop (main thread)" if tid == plane.process.pid
                      else f"thread {tid}")
            print(f"    {thread}: {percent:.2f}%", flush=True)
    return figures


def idle_cases(options: argparse.Namespace) -> list[tuple[str, float]]:
    """One plane (this checkout), or with --compare-with two side by side, measured over
    the same windows: one deployment, then three."""
    from tests.services import PrivateRedis

    roots = {"this": ROOT}
    if options.compare_with:
        roots["other"] = Path(options.compare_with).resolve()
    planes: dict[str, Plane] = {}
    figures = []
    redis = None
    if options.redis:
        redis = PrivateRedis(free_port(), Path(tempfile.mkdtemp(prefix="idle-cpu-redis-")))
        redis.start()
    try:
        for index, (name, root) in enumerate(roots.items()):
            folder = Path(tempfile.mkdtemp(prefix="idle-cpu-bench-"))
            extra = {"REDIS_URL": f"redis://127.0.0.1:{redis.port}/{index + 1}"} if redis else {}
            env = prepared_env(folder, vllm=options.vllm, root=root, **extra)
            planes[name] = start_plane(folder, vllm=options.vllm, env=env, root=root)
        first = ["smollm2"] if options.vllm else ["idle-1"]
        for plane in planes.values():
            if not options.vllm:
                add_fake_deployment(plane, "idle-1")
        for plane in planes.values():
            wait_ready(plane, first, 600 if options.vllm else 120)
        with_redis = ", REDIS_URL" if redis else ""
        kind = "the demo deployment (real vLLM)" if options.vllm else "1 fake deployment"
        measured = report(f"idle, {kind}{with_redis}", planes, options.seconds)
        figures.append((kind + with_redis, measured["this"]))
        more = ["idle-2", "idle-3"]
        for plane in planes.values():
            for name in more:
                add_fake_deployment(plane, name)
        for plane in planes.values():
            wait_ready(plane, [*first, *more], 120)
        label = f"3 deployments ({kind} + 2 fake)" if options.vllm else "3 fake deployments"
        label += with_redis
        measured = report(f"idle, {label}", planes, options.seconds)
        figures.append((label, measured["this"]))
    finally:
        for plane in planes.values():
            plane.stop()
        if redis:
            redis.stop()
    return figures


def relay_comparison(options: argparse.Namespace) -> None:
    """Embedded `serve` against `serve --no-controllers` beside `run_controllers`: two
    planes, each with one fake replica (10 ms/token) and its own database, the same private
    Redis (the split layout needs it for the route table; the embedded one is given it too,
    so that only the process layout differs); rounds interleaved, direct first."""
    from bench.stream_load import load
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
        # Local replicas demand their deployment's engine key, as the gateway sends it.
        engine_key = run_manage(ROOT, planes["embedded"].env, "shell", "-c", (
            "from controlplane.models import Deployment; "
            "print(Deployment.objects.get(name='relay').upstream_key())")
            ).stdout.strip().splitlines()[-1]
        streams, tokens = options.relay_streams, 128
        cpu = {name: 0.0 for name in planes}
        events = {name: 0 for name in planes}
        ttfts: dict[str, list[float]] = {name: [] for name in planes}
        direct: list[float] = []
        for plane in planes.values():  # warm connection pools at this concurrency
            asyncio.run(load(plane.api.url, "relay", streams, 8, plane.api.key, 1))
        for number in range(options.relay_rounds):
            direct += asyncio.run(load(engine, "relay", streams, tokens, engine_key, 1)).ttfts
            # The two layouts take turns going first, so neither always follows the other.
            order = list(planes.items())
            for name, plane in order if number % 2 == 0 else reversed(order):
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
    parser.add_argument("--redis", action="store_true", help="give each plane REDIS_URL "
                        "(a private redis-server's database) for the idle cases")
    parser.add_argument("--compare-with", metavar="PATH", help="another checkout of the "
                        "project, idle beside this one over the same windows")
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
