"""Fleet scale: the control plane with N external deployments, idle, and how fast it stays.

Starts `manage.py serve` (controllers in the process) on a fresh data folder (SQLite, or the
empty database of `--database-url`), creates `--models` models, then N external backends and
N deployments through the REST API (one backend per deployment, each its own endpoint URL:
deployments on one URL and key share a probe, which would hide what a fleet costs). A
fraction (`--answering`) points at FAKE engines (fakes/engine.py, `--engines` processes,
each listening on a port per deployment, each port an engine of its own); the rest point at
a closed port on 127.0.0.1 (no process listens there: every probe is refused at once), or
with `--unanswering silent` at a port whose connections are never answered (every probe
waits out its timeout), each with a path of its own. (A TEST-NET
address is refused at once on the development machine, so it times nothing out there.)
Then it measures:

- idle CPU (user + system seconds of the process and its children over `--idle-seconds`,
  psutil) and RSS of `serve`; then of `serve --no-controllers` and a separate
  `manage.py run_controllers` (both with `REDIS_URL` set to a private `redis-server`, as
  docs/operations.md asks for controllers in another process);
- the largest page and REST API response (median time of 3 GETs, bytes of the body): the
  main pages and the list endpoints with their default pagination;
- the fleet WebSocket's message size (`/ws/dashboard/`, the fleet dashboard's socket);
- restart-to-routable: `serve` and its children killed with SIGKILL, started again, the
  time from the new process's start until a completion to an answering deployment through
  the gateway succeeds;
- audit events written per hour, extrapolated from the idle windows (which start once the
  fleet has settled: every replica ready or told unreachable, no audit event for 10 s, and
  at least `--rest-seconds` after it was created, when the probes of the endpoints that
  never answered are at their backoff's bound);
- the no-change reconcile pass: the controllers expose no pass time, so it is timed here,
  in-process, as bench/reconcile_cost.py does, on the same database once every server has
  stopped (probes paced out of the timed passes; the first pass, which probes every
  endpoint, is printed too).

Each figure is printed against its target from the fleet-scale issue; the last line counts
the targets met.

    .venv/bin/python bench/fleet_scale.py [--deployments 1000] [--answering 0.1]
        [--idle-seconds 60] [--rest-seconds 75] [--database-url URL] [--profile DIR]
    .venv/bin/python bench/fleet_scale.py --deployments 100 --idle-seconds 20   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.dashboard_fanout import session_cookie  # noqa: E402
from bench.planes import ControlPlane  # noqa: E402
from bench.profile_summary import summarize_profile  # noqa: E402
from tests.processes import free_port, start_server, stop_server, wait_healthy  # noqa: E402

PAGES = ("/deployments/", "/models/", "/dashboard/", "/keys/", "/users/")
APIS = ("/api/v1/deployments/", "/api/v1/models/", "/api/v1/backends/",
        "/api/v1/replicas/", "/api/v1/events/", "/api/v1/keys/")
IDLE_CPU_TARGET = 5.0  # percent of one core
RESPONSE_MS_TARGET, RESPONSE_BYTES_TARGET = 100.0, 100_000
RESTART_TARGET = 2.0  # seconds
PASS_TARGET = 1.0  # seconds, bench/reconcile_cost.py's target
# Never the project's environment: bench/gateway_overhead.py puts one in .bench/.
PY_SPY = os.environ.get("PY_SPY", str(ROOT / ".bench" / "router-venv" / "bin" / "py-spy"))


@dataclass
class Report:
    """Rows of (figure, value, target or '', met or None)."""

    rows: list[tuple[str, str, str, bool | None]] = field(default_factory=list)

    def add(self, figure: str, value: str, target: str = "", met: bool | None = None) -> None:
        self.rows.append((figure, value, target, met))
        mark = "" if met is None else (" [met]" if met else " [MISSED]")
        print(f"  {figure}: {value}" + (f" (target: {target}){mark}" if target else ""),
              flush=True)

    def print(self) -> None:
        print("\n| figure | value | target | |\n| --- | --- | --- | --- |")
        for figure, value, target, met in self.rows:
            mark = "" if met is None else ("met" if met else "**missed**")
            print(f"| {figure} | {value} | {target} | {mark} |")
        judged = [met for *_, met in self.rows if met is not None]
        print(f"\nfleet scale: {sum(judged)} of {len(judged)} targets met")


def start_any_model_engine(ports: int, folder: Path) -> tuple[subprocess.Popen[bytes],
                                                                list[str]]:
    """A FAKE engine that serves a request for any model name (bench/any_model.py) on
    `ports` ports, each an engine of its own (its own queue and metrics): one endpoint
    per deployment, as a real fleet has, so that no two deployments share a probe."""
    port = free_port()
    ports_file = folder / f"engine-{port}.ports"
    process = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port", str(port),
                                "--model", "fake", "--token-interval-ms", "5", "--middleware",
                                "bench.any_model.AnyModelName", "--extra-ports",
                                str(max(0, ports - 1)), "--ports-file", str(ports_file)],
                               cwd=ROOT)
    wait_healthy(f"http://127.0.0.1:{port}", 30, process)
    urls = [f"http://127.0.0.1:{line}" for line in ports_file.read_text().split()]
    return process, urls


def tree(pid: int) -> list[psutil.Process]:
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def tree_cpu(pid: int) -> float:
    total = 0.0
    for process in tree(pid):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss_mib(pid: int) -> float:
    total = 0
    for process in tree(pid):
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def audit_events() -> int:
    from django.db import connection

    from controlplane.models import AuditEvent

    count = AuditEvent.objects.count()
    connection.close()  # no read transaction left open on the server's database
    return count


class Fleet:
    """The product, its engines and the N deployments."""

    def __init__(self, options: argparse.Namespace) -> None:
        extra = {"DATABASE_URL": options.database_url} if options.database_url else {}
        self.options = options
        self.product = ControlPlane(**extra)
        self.port = self.product.port
        answering = round(options.deployments * options.answering)
        per_engine = max(1, -(-answering // max(1, options.engines)))
        self.engines = [start_any_model_engine(per_engine, Path(self.product.env["DATA_DIR"]))
                        for _ in range(options.engines)]
        if options.unanswering == "silent":
            # Listens (the kernel completes each handshake) but never accepts nor answers:
            # every probe waits out its timeout.
            self.silent = socket.create_server(("127.0.0.1", 0), backlog=4096)
            self.closed = f"http://127.0.0.1:{self.silent.getsockname()[1]}"
        else:
            self.closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        self.names = [f"fleet-{i:05d}" for i in range(options.deployments)]
        self.answering = self.names[:answering]
        os.environ.update(self.product.env)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        # The in-process pass below is timed between probes, as in bench/reconcile_cost.py.
        os.environ["HEALTH_CHECK_SECONDS"] = "3600"
        import django

        django.setup()

    def endpoint(self, index: int) -> str:
        """Deployment `index`'s URL, its own: an engine's port of its own, or the closed
        (or silent) port with a path of its own (deployments on one URL and key share a
        probe, which would hide what a fleet of endpoints costs)."""
        if index < len(self.answering):
            engine = index % len(self.engines)
            return self.engines[engine][1][index // len(self.engines)]
        return f"{self.closed}/d{index}"

    def create(self) -> list[float]:
        """Models, backends and deployments through the REST API, 4 requests at a time;
        returns each deployment POST's seconds, in order."""
        models = max(1, self.options.models)
        headers = {"Authorization": f"Bearer {self.product.admin}"}
        local = threading.local()

        def post(path: str, body: dict[str, Any]) -> float:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=self.product.url, headers=headers,
                                            timeout=120)
            started = time.monotonic()
            response = local.client.post(path, json=body)
            if response.status_code >= 300:
                raise SystemExit(f"{path}: {response.status_code} {response.text[:300]}")
            return time.monotonic() - started

        def deployment(i: int) -> float:
            post("/api/v1/backends/", {"name": f"{self.names[i]}-endpoint", "kind": "external",
                                       "config": {"url": self.endpoint(i)}})
            return post("/api/v1/deployments/", {
                "name": self.names[i], "model": f"fleet-model-{i % models:04d}",
                "backend": f"{self.names[i]}-endpoint"})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda m: post("/api/v1/models/", {
                "name": f"fleet-model-{m:04d}", "source": "huggingface",
                "hf_id": f"bench/fleet-{m}"}), range(models)))
            print(f"created {models} models", flush=True)
            seconds: list[float] = []
            step = max(1, len(self.names) // 10)
            for start in range(0, len(self.names), step):
                seconds += pool.map(deployment, range(start, min(start + step,
                                                                 len(self.names))))
                print(f"created {len(seconds)} of {len(self.names)} deployments "
                      f"(last batch: {statistics.median(seconds[start:]) * 1000:.0f} ms per "
                      f"deployment POST, median)", flush=True)
        return seconds

    def routable(self, url: str) -> int:
        """How many answering deployments the gateway at `url` lists with a ready replica."""
        models = httpx.get(f"{url}/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {self.product.key}"}).json()
        ready = {m["id"] for m in models["data"] if m.get("ready_replicas")}
        return len(ready.intersection(self.answering))

    def wait_routable(self, url: str, timeout: float) -> float:
        started = time.monotonic()
        while (count := self.routable(url)) < len(self.answering):
            if time.monotonic() - started > timeout:
                raise SystemExit(f"only {count} of {len(self.answering)} answering "
                                 f"deployments routable after {timeout:.0f} s")
            time.sleep(1)
        return time.monotonic() - started

    def wait_settled(self, timeout: float = 600) -> float:
        """Until every deployment's replica is ready or told unreachable (each probed at
        least once; probes that time out take a while) and no audit event was written over
        the last 10 s: the idle windows measure a fleet at rest, not its convergence."""
        from controlplane.models import AuditEvent, Replica

        started, last = time.monotonic(), -1
        while time.monotonic() - started < timeout:
            probed = Replica.objects.filter(phase=Replica.Phase.READY).count() + \
                AuditEvent.objects.filter(action="replica-unreachable").values(
                    "replica_name").distinct().count()
            events = audit_events()
            if probed >= len(self.names) and events == last:
                return time.monotonic() - started
            last = events
            time.sleep(10)
        raise SystemExit(f"the fleet did not settle within {timeout:.0f} s")

    def stop(self) -> None:
        for engine, _ in self.engines:
            engine.kill()
            engine.wait(timeout=10)


PROFILE_RATE = 100  # py-spy samples a second


def idle_window(pids: dict[str, int], seconds: float,
                profile: str = "") -> tuple[dict[str, float], float]:
    """CPU percent of one core per process tree over the window, and audit events per hour
    written during it. With `profile` (a folder), py-spy samples each process meanwhile
    (`--nonblocking`, so the sampled processes run on) and its summary is printed."""
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
    samplers = {name: subprocess.Popen(
        [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
         str(PROFILE_RATE), "--format", "raw", "--threads", "--nonblocking", "--output",
         str(Path(profile) / f"{name}-{pid}.txt")], stdout=subprocess.DEVNULL)
        for name, pid in pids.items()} if profile else {}
    events, cpu, started = audit_events(), {n: tree_cpu(p) for n, p in pids.items()}, \
        time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    used = {n: (tree_cpu(p) - cpu[n]) / elapsed * 100 for n, p in pids.items()}
    for name, sampler in samplers.items():
        sampler.wait(timeout=60)
        print(summarize_profile(Path(profile) / f"{name}-{pids[name]}.txt", seconds,
                                PROFILE_RATE), flush=True)
    return used, (audit_events() - events) / elapsed * 3600


def timed_get(client: httpx.Client, path: str) -> tuple[float, int, int]:
    """Median seconds of 3 GETs, the body's bytes, the status."""
    times, size, status = [], 0, 0
    for _ in range(3):
        started = time.monotonic()
        response = client.get(path)
        times.append(time.monotonic() - started)
        size, status = len(response.content), response.status_code
    return statistics.median(times), size, status


def responses(fleet: Fleet, report: Report) -> None:
    url = fleet.product.url
    password = "fleet-bench-password"
    fleet.product.create_superuser("fleet", password)
    cookie = session_cookie(url, "fleet", password)
    pages = [*PAGES, f"/deployments/{fleet.names[-1]}/"]
    if fleet.answering:
        pages.append(f"/deployments/{fleet.answering[0]}/")
    for label, paths, headers in (
            ("page", pages, {"Cookie": cookie}),
            ("API response", APIS, {"Authorization": f"Bearer {fleet.product.admin}"})):
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            figures = {path: timed_get(client, path) for path in paths}
        for path, (seconds, size, status) in figures.items():
            print(f"  {path}: HTTP {status}, {seconds * 1000:.0f} ms, {size:,} bytes")
        slowest = max(figures, key=lambda p: figures[p][0])
        largest = max(figures, key=lambda p: figures[p][1])
        report.add(f"slowest {label} ({slowest})", f"{figures[slowest][0] * 1000:.0f} ms",
                   f"under {RESPONSE_MS_TARGET:.0f} ms",
                   figures[slowest][0] * 1000 < RESPONSE_MS_TARGET)
        report.add(f"largest {label} ({largest})", f"{figures[largest][1]:,} bytes",
                   f"under {RESPONSE_BYTES_TARGET // 1000} KB",
                   figures[largest][1] < RESPONSE_BYTES_TARGET)
    report.add("fleet WebSocket message (/ws/dashboard/), largest",
               *fleet_message(url, cookie))


def fleet_message(url: str, cookie: str) -> tuple[str, str, bool]:
    """The largest message the fleet socket sends within three scrape intervals."""
    from websockets.asyncio.client import connect

    async def listen() -> list[int]:
        sizes: list[int] = []
        async with connect(url.replace("http://", "ws://") + "/ws/dashboard/",
                           additional_headers={"Cookie": cookie, "Origin": url},
                           max_size=None) as socket:
            deadline = time.monotonic() + 6.5
            while (left := deadline - time.monotonic()) > 0:
                try:
                    message = await asyncio.wait_for(socket.recv(), timeout=left)
                except TimeoutError:
                    break
                sizes.append(len(message.encode() if isinstance(message, str) else message))
        return sizes

    sizes = asyncio.run(listen())
    if not sizes:
        return "no message in 6.5 s", f"under {RESPONSE_BYTES_TARGET // 1000} KB", False
    return (f"{max(sizes):,} bytes ({len(sizes)} messages in 6.5 s)",
            f"under {RESPONSE_BYTES_TARGET // 1000} KB (the pages' target)",
            max(sizes) < RESPONSE_BYTES_TARGET)


def restart_to_routable(fleet: Fleet, process: subprocess.Popen[str]) -> tuple[
        subprocess.Popen[str], float, float]:
    """SIGKILL the server's tree, start it again: seconds to the first HTTP answer and to
    the first completion served through the gateway."""
    for member in reversed(tree(process.pid)):
        member.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    log = open(Path(fleet.product.env["DATA_DIR"]) / "serve-restarted.log", "w")
    started = time.monotonic()
    restarted = subprocess.Popen([sys.executable, "manage.py", "serve", "--port",
                                  str(fleet.port)], cwd=ROOT, env=fleet.product.env,
                                 stdout=log, stderr=subprocess.STDOUT, text=True)
    answered = 0.0
    body = {"model": fleet.answering[0], "prompt": "hi", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {fleet.product.key}"}
    while time.monotonic() - started < 120 and restarted.poll() is None:
        try:
            response = httpx.post(f"{fleet.product.url}/v1/completions", json=body,
                                  headers=headers, timeout=5)
        except httpx.HTTPError:
            time.sleep(0.02)
            continue
        answered = answered or time.monotonic() - started
        if response.status_code == 200:
            return restarted, answered, time.monotonic() - started
        time.sleep(0.02)
    raise SystemExit("the restarted server did not route within 120 s")


def embedded(fleet: Fleet, report: Report) -> None:
    """Figures of `serve` with the controllers in it."""
    process = fleet.product.process
    cpu, events = idle_window({"serve": process.pid}, fleet.options.idle_seconds,
                              fleet.options.profile)
    report.add("idle CPU, `serve` (controllers in the process)", f"{cpu['serve']:.1f}% of "
               "one core", f"under {IDLE_CPU_TARGET:.0f}%", cpu["serve"] < IDLE_CPU_TARGET)
    report.add("RSS, `serve` and its children", f"{tree_rss_mib(process.pid):.0f} MiB")
    report.add("audit events written per hour, `serve` idle", f"{events:,.0f}")
    responses(fleet, report)
    if not fleet.answering:
        fleet.product.stop()
        return
    restarted, answered, routed = restart_to_routable(fleet, process)
    report.add("restart (SIGKILL) to first HTTP answer", f"{answered:.2f} s")
    report.add("restart (SIGKILL) to routable (a completion served)", f"{routed:.2f} s",
               f"under {RESTART_TARGET:.0f} s", routed < RESTART_TARGET)
    stop_server(restarted)


def apart(fleet: Fleet, report: Report) -> None:
    """Figures of `serve --no-controllers` beside `run_controllers`, sharing a private
    Redis."""
    from tests.services import private_redis

    with private_redis() as redis:
        env = {**fleet.product.env, "REDIS_URL": redis.url}
        server, _ = start_server(env, fleet.port, "--no-controllers")
        log = open(Path(env["DATA_DIR"]) / "run-controllers.log", "w")
        controllers = subprocess.Popen([sys.executable, "manage.py", "run_controllers"],
                                       cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
        try:
            print(f"apart: routable after {fleet.wait_routable(fleet.product.url, 300):.1f} s, "
                  f"settled after {fleet.wait_settled():.0f} s more", flush=True)
            cpu, events = idle_window({"serve": server.pid, "controllers": controllers.pid},
                                      fleet.options.idle_seconds, fleet.options.profile)
            rss = {"serve": tree_rss_mib(server.pid),
                   "controllers": tree_rss_mib(controllers.pid)}
        finally:
            controllers.terminate()
            controllers.wait(timeout=60)
            stop_server(server)
    for name, label in (("serve", "`serve --no-controllers`"),
                        ("controllers", "`run_controllers`")):
        report.add(f"idle CPU, {label}", f"{cpu[name]:.1f}% of one core",
                   f"under {IDLE_CPU_TARGET:.0f}%", cpu[name] < IDLE_CPU_TARGET)
        report.add(f"RSS, {label} and its children", f"{rss[name]:.0f} MiB")
    report.add("audit events written per hour, `run_controllers` idle", f"{events:,.0f}")


def no_change_pass(report: Report, passes: int = 5) -> None:
    from django.conf import settings
    from django.db import reset_queries

    from controlplane.reconciler import Reconciler

    reconciler = Reconciler()
    # Every endpoint due at once (a new process spreads them over its first interval).
    settings.HEALTH_CHECK_SECONDS, paced = 0.0, settings.HEALTH_CHECK_SECONDS
    first = reconciler.reconcile_all()
    settings.HEALTH_CHECK_SECONDS = paced
    print(f"  first pass in this process (probes every endpoint): {first.seconds:.2f} s, "
          f"{first.changed} changed", flush=True)
    results = []
    for _ in range(passes):
        results.append(reconciler.reconcile_all())
        reset_queries()
    median = statistics.median(r.seconds for r in results)
    changed = max(r.changed for r in results)
    report.add(f"reconcile pass, nothing to change (median of {passes}, in-process; "
               f"deployments changed per pass: up to {changed})", f"{median * 1000:.0f} ms",
               f"under {PASS_TARGET * 1000:.0f} ms", median < PASS_TARGET)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=1000)
    parser.add_argument("--models", type=int, default=None,
                        help="models the deployments share (default: a tenth of them)")
    parser.add_argument("--answering", type=float, default=0.1,
                        help="fraction of deployments on answering fake engines")
    parser.add_argument("--unanswering", choices=("refused", "silent"), default="refused",
                        help="where the other deployments point: a closed port (refused at "
                             "once) or a port that never answers (each probe times out)")
    parser.add_argument("--engines", type=int, default=4, help="fake engine processes")
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--rest-seconds", type=float, default=75,
                        help="the idle windows start at least this long after the fleet "
                             "was created: the default is when the probes of endpoints "
                             "that never answered reach the backoff's bound (failures at "
                             "5, 10, 20 and 40 s intervals with the default settings; 0 "
                             "measures the fleet as soon as it has settled)")
    parser.add_argument("--profile", metavar="DIR", default="",
                        help="py-spy samples each idle window's processes into DIR "
                             f"(py-spy from PY_SPY, default {PY_SPY}) and its summary is "
                             "printed")
    parser.add_argument("--database-url", default="",
                        help="an empty database (default: SQLite in a fresh data folder)")
    options = parser.parse_args()
    if not 0 < options.deployments or not 0 <= options.answering <= 1:
        parser.error("--deployments must be positive and --answering within 0..1")
    options.models = options.models or max(1, options.deployments // 10)
    report = Report()
    fleet = Fleet(options)
    try:
        started = time.monotonic()
        seconds = fleet.create()
        tenth = max(1, len(seconds) // 10)
        report.add("creating the fleet (REST API, 4 at a time)",
                   f"{time.monotonic() - started:.0f} s; a deployment POST took "
                   f"{statistics.median(seconds[:tenth]) * 1000:.0f} ms (median) in the first "
                   f"tenth, {statistics.median(seconds[-tenth:]) * 1000:.0f} ms in the last")
        created = time.monotonic()
        print(f"routable after {fleet.wait_routable(fleet.product.url, 600):.1f} s more",
              flush=True)
        print(f"settled (every replica ready or told unreachable, no audit event for 10 s) "
              f"after {fleet.wait_settled():.0f} s more", flush=True)
        rest = options.rest_seconds - (time.monotonic() - created)
        if rest > 0:
            print(f"at rest in {rest:.0f} s more (the unreachable endpoints' probe backoff "
                  f"at its bound {options.rest_seconds:.0f} s after they were created)",
                  flush=True)
            time.sleep(rest)
        run_steps(fleet, report, [embedded, apart])
        no_change_pass(report)
    finally:
        if fleet.product.process.poll() is None:
            fleet.product.stop()
        fleet.stop()
    report.print()


def run_steps(fleet: Fleet, report: Report,
              steps: list[Callable[[Fleet, Report], None]]) -> None:
    for step in steps:
        print(f"{step.__name__}:", flush=True)
        step(fleet, report)


if __name__ == "__main__":
    main()
