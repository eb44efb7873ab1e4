"""Gateway overhead: the same load sent straight to the engines, through the gateway and
through vLLM's Rust router (`vllm-router` from PyPI), side by side, in one run.

The loads (--loads picks a subset, --rounds sets how many interleaved rounds):
- paced-1, paced-16, paced-128: the FAKE engine (fakes/engine.py) emitting one token every
  10 ms, 1, 16 and 128 concurrent streams of 256 tokens;
- unpaced-1, unpaced-64: the fake engine as fast as it can, 1 and 64 streams;
- with --vllm: afterwards the real vLLM CPU server with the demo model, 1 and 32 streams,
  direct and through the gateway.

The gateway is the product itself (`manage.py serve`, controllers included) with each
engine registered as an external deployment; unless --no-gateway-only, also alone in its
process (`serve --no-controllers` beside `run_controllers`, sharing the database and a
private `redis-server`), its CPU counted without the controllers'. The load key has rate
limits no load reaches, so the limiter is in the measured path (in Redis for the gateway
alone). The router runs round_robin over one worker,
one router per engine, from the benchmark's own virtual environment (.bench/router-venv,
ignored by git, created on first use; never the project's). Rounds are interleaved (direct,
gateway, router, direct, ...) so every path sees the same machine. Per path and load it
prints TTFT p50/p99, the added TTFT against direct, the throughput ratio to direct and the
CPU time per relayed event of the relaying process (psutil: user + system seconds of the
process, every thread, over the events the client received in that path's rounds; the
least noisy figure on a shared machine), also net of the process's CPU with no traffic,
and each round's burst: from its start until every stream had its first token, with how
many cores the whole machine kept busy meanwhile (whether a burst's TTFT waits for a full
machine or for one busy process);
then one markdown table and, on the last lines, each target of the gateway against the
router (added TTFT p50 within the router's + 2 ms, throughput ratio at least the router's,
CPU per event at most the router's) met or missed.

With --compare-with PATH (another checkout of the project, e.g. a `git worktree` of an
older commit with the same .venv), a second server runs that checkout's code before the
same engines instead, and each load is sent to the two in interleaved rounds (A, B, A, B);
it prints each server's CPU time per relayed event and their ratio, and how often each
server's cycle collector ran per 100 requests (python_gc_collections_total on its
/metrics, read around each of its rounds). With --local, the
engines are replicas each control plane runs itself (a `local` backend whose interpreter
is fakes/vllm_cli.py's stand-in, the same fake engine): their streams carry vLLM's usage
so far on every chunk (`continuous_usage_stats`), which the gateway reads and takes out,
as for any replica the control plane runs; external deployments skip that work.

With --profile PATH, py-spy (from the benchmark's environment) samples the gateway process
while 128 paced streams go through it, writes the raw collapsed stacks to PATH and prints
where the time goes (bench/profile_summary.py); with --profile-idle, the gateway with no
traffic instead (its background: controllers, collector, load watcher).

    .venv/bin/python bench/gateway_overhead.py [--loads NAME,...] [--rounds N] [--quick]
        [--no-router] [--no-gateway-only] [--workers N] [--vllm]
        [--compare-with PATH [--local] [--redis]]
        [--profile PATH [--profile-native | --profile-idle]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.profile_summary import summarize_profile  # noqa: E402
from bench.stream_load import Run, load  # noqa: E402  (the other benchmarks import it here)
from fakes.vllm_cli import stand_in_python  # noqa: E402
from tests.processes import (  # noqa: E402
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)

ROUTER_VERSION = "0.1.17"
# The load key's limits: far above any load here (64 unpaced streams relay about 11
# million tokens a minute), never refusing, always checked.
KEY_RPM, KEY_TPM = 100_000_000, 2_000_000_000
ROUTER_ENV = ROOT / ".bench" / "router-venv"


def compare(label: str, direct_url: str, gateway_url: str, model: str, streams: int,
            tokens: int, key: str, rounds: int) -> tuple[Run, Run]:
    # Warm both paths at the measured concurrency, so both measure warm connection pools.
    asyncio.run(load(direct_url, model, streams, 8, None, 1))
    asyncio.run(load(gateway_url, model, streams, 8, key, 1))
    # Interleaved round by round (direct, gateway, direct, gateway ...), so both paths
    # see the same machine: on shared cores the machine's speed drifts within minutes.
    direct, through = Run([], 0, 0.0, 0), Run([], 0, 0.0, 0)
    for _ in range(rounds):
        for total, url, with_key in ((direct, direct_url, None), (through, gateway_url, key)):
            run = asyncio.run(load(url, model, streams, tokens, with_key, 1))
            total.ttfts += run.ttfts
            total.tokens += run.tokens
            total.seconds += run.seconds
            total.errors += run.errors
    print(f"{label}: {streams} streams x {tokens} tokens | direct TTFT p50 "
          f"{direct.p(0.5):.2f} ms p99 {direct.p(0.99):.2f} ms, {direct.rate:,.0f} tok/s | "
          f"gateway TTFT p50 {through.p(0.5):.2f} ms p99 {through.p(0.99):.2f} ms, "
          f"{through.rate:,.0f} tok/s | added TTFT p50 {through.p(0.5) - direct.p(0.5):+.2f} ms"
          f" p99 {through.p(0.99) - direct.p(0.99):+.2f} ms | ratio "
          f"{through.rate / direct.rate:.3f} | errors {direct.errors}/{through.errors}",
          flush=True)
    return direct, through


def start_engine(interval_ms: float, model: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port", str(port),
                                "--model", model, "--token-interval-ms", str(interval_ms)],
                               cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30)
    return process, url


class ControlPlane:
    """The control plane, with engines registered as external deployments."""

    root = ROOT  # whose code runs: this checkout's
    serve_options: tuple[str, ...] = ()  # `manage.py serve`'s, e.g. --no-controllers

    def __init__(self, **extra_env: str) -> None:
        data = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        root = self.root
        self.env = server_env(data / "data", LOG_LEVEL="WARNING", **extra_env)
        self.manage("migrate", "--noinput", "-v0")
        self.admin = self.manage("create_api_key", "--name", "bench", "--scope",
                                 "admin").stdout.strip().splitlines()[-1]
        # Rate limits no load here reaches, so the limiter is in the measured path (with
        # REDIS_URL, a Redis round trip per request) as on a shared fleet.
        self.key = self.manage("create_api_key", "--name", "load", "--scope", "inference",
                               "--rpm", str(KEY_RPM), "--tpm", str(KEY_TPM)
                               ).stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if root == ROOT:
            self.process, _ = start_server(self.env, self.port, *self.serve_options)
        else:
            self.process = start_server_in(root, self.env, self.port)

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A manage.py command of this product's checkout."""
        if self.root == ROOT:
            return manage(self.env, *args)
        return subprocess.run([sys.executable, "manage.py", *args], cwd=self.root,
                              env=self.env, capture_output=True, text=True, timeout=300,
                              check=True)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far."""
        import psutil

        times = psutil.Process(self.process.pid).cpu_times()
        return float(times.user + times.system)

    def api(self, path: str, body: dict[str, object]) -> None:
        response = httpx.post(self.url + path, json=body, timeout=30,
                              headers={"Authorization": f"Bearer {self.admin}"})
        if response.status_code >= 300:
            raise SystemExit(f"{path}: {response.status_code} {response.text}")

    def route(self, name: str, engine_url: str) -> None:
        self.api("/api/v1/models/", {"name": f"{name}-model", "source": "huggingface",
                                     "hf_id": f"bench/{name}"})
        self.api("/api/v1/backends/", {"name": f"{name}-endpoint", "kind": "external",
                                       "config": {"url": engine_url}})
        self.api("/api/v1/deployments/", {"name": name, "model": f"{name}-model",
                                          "backend": f"{name}-endpoint",
                                          "engine_args": {"served_model_name": name}})
        self.wait_routable(name)

    def run_locally(self, name: str, python: str) -> None:
        """`name` served by one replica this control plane runs (a local backend whose
        interpreter is `python`, a stand-in serving the fake engine)."""
        weights = Path(tempfile.mkdtemp(prefix=f"gateway-bench-{name}-weights-"))
        self.manage("shell", "-c", "from tests.factories import make_model; "
                                   f"make_model({name + '-model'!r}, path={str(weights)!r})")
        self.api("/api/v1/backends/", {"name": f"{name}-fakes", "kind": "local",
                                       "config": {"python": python}})
        self.api("/api/v1/deployments/", {"name": name, "model": f"{name}-model",
                                          "backend": f"{name}-fakes", "replicas": 1,
                                          "engine_args": {"served_model_name": name}})
        self.wait_routable(name)

    def wait_routable(self, name: str) -> None:
        """Until the gateway lists `name` with a ready replica."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            models = httpx.get(f"{self.url}/v1/models", timeout=5,
                               headers={"Authorization": f"Bearer {self.key}"}).json()
            if any(m["id"] == name and m["ready_replicas"] for m in models["data"]):
                return
            time.sleep(0.5)
        raise SystemExit(f"deployment {name} did not become routable")

    def create_superuser(self, username: str, password: str) -> None:
        """A browser login for the benchmarks that drive pages or sockets."""
        subprocess.run([sys.executable, "manage.py", "shell", "-c",
                        "from django.contrib.auth.models import User; "
                        f"User.objects.create_superuser({username!r}, '', {password!r})"],
                       cwd=ROOT, env=self.env, check=True, capture_output=True)

    def stop(self) -> None:
        """Stop the server, and the collector's parsing worker and its resource tracker,
        which outlive a stopped `serve` (they are left running, parented to init)."""
        import psutil

        try:
            helpers = [child for child in psutil.Process(self.process.pid).children(True)
                       if "multiprocessing" in " ".join(child.cmdline())]
        except psutil.Error:
            helpers = []
        stop_server(self.process)
        for helper in helpers:
            with contextlib.suppress(psutil.Error):
                helper.kill()
        end_replicas(self.env["DATA_DIR"])  # replicas it ran (they outlive it on purpose)


class OtherCheckout(ControlPlane):
    """The control plane of another checkout of the project (its code, the same venv)."""

    def __init__(self, root: Path, extra_env: dict[str, str]) -> None:
        self.root = root
        super().__init__(**extra_env)


class GatewayOnly(ControlPlane):
    """The gateway in a process of its own (`manage.py serve --no-controllers`), the
    controllers and collector in another (`manage.py run_controllers`), sharing the
    database and a Redis server (the route table reaches the gateway through it). Its
    CPU figures are the gateway process's alone."""

    serve_options = ("--no-controllers",)

    def __init__(self, redis_url: str, **extra_env: str) -> None:
        super().__init__(REDIS_URL=redis_url, **extra_env)
        self.controllers = subprocess.Popen(
            [sys.executable, "manage.py", "run_controllers"], cwd=ROOT, env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """The gateway, then the controllers (their replicas: none, all external)."""
        self.controllers.terminate()
        try:
            self.controllers.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.controllers.kill()
        super().stop()


class GatewayWorkers(ControlPlane):
    """`manage.py serve --workers N`: N gateway worker processes on one port, the
    controllers once in their parent, sharing a Redis server (as --workers requires). Its
    CPU figures are the whole process tree's: parent, workers and the collector's helper."""

    def __init__(self, workers: int, redis_url: str, **extra_env: str) -> None:
        self.serve_options = ("--workers", str(workers))
        super().__init__(REDIS_URL=redis_url, **extra_env)

    def route(self, name: str, engine_url: str) -> None:
        super().route(name, engine_url)
        wait_routed_by_every_worker(self, name)


def wait_routed_by_every_worker(plane: ControlPlane, name: str) -> None:
    """Until 20 fresh connections in a row (spread over the workers by the kernel) find
    `name` routable: each worker takes the route table from Redis on its own."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(any(m["id"] == name and m["ready_replicas"] for m in httpx.get(
                f"{plane.url}/v1/models", timeout=5, headers={
                    "Authorization": f"Bearer {plane.key}"}).json()["data"])
               for _ in range(20)):
            return
        time.sleep(0.2)
    raise SystemExit(f"deployment {name} not routed by every worker")


def start_server_in(root: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    """`manage.py serve` of another checkout, once it answers /healthz."""
    process = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port)],
                               cwd=root, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"manage.py serve in {root} did not answer /healthz")


@dataclass(frozen=True)
class Load:
    """One load of the side-by-side table: `streams` clients, each sending `requests`
    streamed completions of `tokens` tokens one after another per round."""

    name: str
    label: str
    model: str  # "fake": the paced engine; "fast": the unpaced one
    streams: int
    requests: int
    tokens: int = 256


LOADS = {load.name: load for load in (
    Load("paced-1", "paced 10 ms/token", "fake", 1, 2),
    Load("paced-16", "paced 10 ms/token", "fake", 16, 1),
    Load("paced-128", "paced 10 ms/token", "fake", 128, 1),
    # Unpaced rounds repeat requests so that a round lasts about a second, not a few ms.
    Load("unpaced-1", "unpaced", "fast", 1, 50),
    Load("unpaced-64", "unpaced", "fast", 64, 8),
)}


@dataclass
class Endpoint:
    """One path to the engines: the engines themselves, the gateway or the routers."""

    name: str
    urls: dict[str, str]  # model -> base URL
    key: str | None
    pids: dict[str, int]  # model -> the process that relays it; none for the engine
    metrics: str | None = None  # the control plane's /metrics, where it has one

    def collections(self) -> int:
        """The cycle collector's runs in the relaying process so far (every generation),
        from its /metrics (python_gc_collections_total); 0 without one."""
        if self.metrics is None:
            return 0
        text = httpx.get(self.metrics, timeout=10).text
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("python_gc_collections_total{"))

    def cpu_seconds(self, model: str) -> float:
        """User + system CPU of the process relaying `model` and its children (every
        thread) so far; 0 for the engine itself."""
        import psutil

        if model not in self.pids:
            return 0.0
        total = 0.0
        process = psutil.Process(self.pids[model])
        for member in (process, *helpers_of(process)):
            with contextlib.suppress(psutil.Error):
                times = member.cpu_times()
                total += times.user + times.system
        return total


@dataclass
class Side:
    """One path's figures over the interleaved rounds of one load."""

    runs: list[Run]
    cpu: float  # seconds of the path's process CPU over its rounds
    idle: float = 0.0  # the process's CPU per second with no traffic (its background)
    collections: int = 0  # the cycle collector's runs in the process over its rounds

    @property
    def requests(self) -> int:
        """Requests answered over every round."""
        return sum(len(run.ttfts) for run in self.runs)

    @property
    def collections_per_100_requests(self) -> float:
        return self.collections / max(1, self.requests) * 100

    @property
    def events(self) -> int:
        """Events relayed over every round."""
        return sum(run.tokens for run in self.runs)

    @property
    def errors(self) -> int:
        return sum(run.errors for run in self.runs)

    @property
    def cpu_per_event_us(self) -> float:
        """Microseconds of the process's CPU per relayed event."""
        return self.cpu / max(1, self.events) * 1e6

    @property
    def cpu_per_request_ms(self) -> float:
        """Milliseconds of the process's CPU per request answered."""
        return self.cpu / max(1, self.requests) * 1e3

    @property
    def net_cpu_per_event_us(self) -> float:
        """The same, less what the process burns with no traffic over as long."""
        seconds = sum(run.seconds for run in self.runs)
        return max(0.0, self.cpu - self.idle * seconds) / max(1, self.events) * 1e6

    @property
    def burst_cores(self) -> float:
        """Cores the whole machine kept busy, on average, from each round's start until
        every stream had its first token (the burst the TTFT is measured over)."""
        seconds = sum(run.burst_seconds for run in self.runs)
        return sum(run.burst_busy for run in self.runs) / seconds if seconds else 0.0

    @property
    def burst_ms(self) -> float:
        """The burst's mean length, in ms."""
        return sum(run.burst_seconds for run in self.runs) / max(1, len(self.runs)) * 1e3

    def ttft(self, q: float) -> float:
        """A TTFT percentile over every round, in ms."""
        return Run([t for run in self.runs for t in run.ttfts], 0, 1, 0).p(q)

    def ttft_p50(self) -> float:
        return self.ttft(0.5)

    @property
    def rate(self) -> float:
        """Tokens per second over every round."""
        return sum(run.tokens for run in self.runs) / sum(run.seconds for run in self.runs)


def helpers_of(process: object) -> list[object]:
    """A relaying process's own children (the collector's parser), every level down, but
    not the replicas a control plane runs (they carry FLEETPLANE_REPLICA in their
    environment) nor anything below them: those are engines, not relaying."""
    import psutil

    assert isinstance(process, psutil.Process)
    found: list[object] = []
    with contextlib.suppress(psutil.Error):
        for child in process.children():
            with contextlib.suppress(psutil.Error):
                if "FLEETPLANE_REPLICA" not in child.environ():
                    found += [child, *helpers_of(child)]
    return found


def settle(endpoints: list[Endpoint], collecting: list[ControlPlane],
           timeout: float = 60.0) -> None:
    """Before anything is measured: a request down every path, then until the collector
    of each control plane that runs one (the embedded default, the workers' parent) has
    started its parser process, which it does once, at its first parse after the
    engines' figures move. Its start (an interpreter and its imports) is a one-time cost
    of a new server, not part of relaying: left to chance, it could land in the first
    load's measured rounds, where one paced stream relays only a few hundred events."""
    import psutil

    for endpoint in endpoints:
        for model, url in endpoint.urls.items():
            asyncio.run(load(url, model, 1, 8, endpoint.key, 1))
    deadline = time.monotonic() + timeout
    for plane in collecting:
        while not any(isinstance(child, psutil.Process)
                      and "multiprocessing.spawn" in " ".join(child.cmdline())
                      for child in helpers_of(psutil.Process(plane.process.pid))):
            if time.monotonic() > deadline:
                print("note: a collector's parser process had not started after "
                      f"{timeout:g} s; its start may fall in a measured round", flush=True)
                return
            time.sleep(0.5)
    print("every collector's parser process has started (not measured)", flush=True)


def idle_burn(endpoints: list[Endpoint], seconds: float) -> dict[str, list[float]]:
    """Per model, each endpoint's process CPU per second while nothing is sent (one window
    for all)."""
    models = ("fake", "fast")
    before = {model: [endpoint.cpu_seconds(model) for endpoint in endpoints]
              for model in models}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {model: [(endpoint.cpu_seconds(model) - was) / elapsed
                    for endpoint, was in zip(endpoints, before[model], strict=True)]
            for model in models}


def interleave(load_: Load, endpoints: list[Endpoint], rounds: int,
               idle: list[float] | None = None) -> list[Side]:
    """The same load sent to each endpoint in turn, `rounds` times (A, B, C, A, B, C ...),
    each endpoint's process CPU counted over its own rounds only."""
    for endpoint in endpoints:  # warm connection pools at the measured concurrency
        asyncio.run(load(endpoint.urls[load_.model], load_.model, load_.streams, 8,
                         endpoint.key, 1))
    sides = [Side([], 0.0, rate) for rate in idle or [0.0] * len(endpoints)]
    for _ in range(rounds):
        for endpoint, side in zip(endpoints, sides, strict=True):
            collected = endpoint.collections()
            before = endpoint.cpu_seconds(load_.model)
            side.runs.append(asyncio.run(load(endpoint.urls[load_.model], load_.model,
                                              load_.streams, load_.tokens, endpoint.key,
                                              load_.requests)))
            side.cpu += endpoint.cpu_seconds(load_.model) - before
            side.collections += endpoint.collections() - collected
    return sides


def compare_checkouts(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """This checkout's gateway against another's, in interleaved rounds."""
    other_root = Path(options.compare_with).resolve()
    pythons: dict[str, str] = {}
    if options.local:  # a stand-in interpreter per pace, for both control planes
        for model, interval in (("fake", 10.0), ("fast", 0.0)):
            folder = Path(tempfile.mkdtemp(prefix=f"gateway-bench-{model}-"))
            pythons[model] = stand_in_python(folder, token_interval_ms=interval)
        extra_env = {**extra_env, "LOCAL_BACKEND_PYTHONS": ",".join(pythons.values())}
    envs = [extra_env, extra_env]
    with contextlib.ExitStack() as stack:
        if options.redis:  # a private Redis, a database for each control plane
            from tests.services import private_redis

            server = stack.enter_context(private_redis())
            envs = [{**extra_env, "REDIS_URL": server.database_url(db)} for db in (1, 2)]
        compare_two(options, other_root, envs, pythons)


def compare_two(options: argparse.Namespace, other_root: Path, envs: list[dict[str, str]],
                pythons: dict[str, str]) -> None:
    """The body of compare_checkouts: each control plane with its own settings."""
    rounds = options.rounds or (2 if options.quick else 4)
    names = options.loads or ["paced-1", "paced-16", "unpaced-64"]
    products = [ControlPlane(**envs[0]), OtherCheckout(other_root, envs[1])]
    processes: list[subprocess.Popen[bytes]] = []
    summary: list[str] = []
    try:
        if options.local:
            for product in products:
                for model, python in pythons.items():
                    product.run_locally(model, python)
        else:
            paced, paced_url = start_engine(10.0, "fake")
            unpaced, unpaced_url = start_engine(0.0, "fast")
            processes += [paced, unpaced]
            for product in products:
                product.route("fake", paced_url)
                product.route("fast", unpaced_url)
        endpoints = [Endpoint(name, {"fake": p.url, "fast": p.url}, p.key,
                              {"fake": p.process.pid, "fast": p.process.pid},
                              f"{p.url}/metrics")
                     for name, p in zip(("this", "other"), products, strict=True)]
        for name in names:
            load_ = LOADS.get(name) or profile_load(name)
            this, other = interleave(load_, endpoints, rounds)
            print(f"{name}: {load_.streams} streams x {load_.tokens} tokens, {rounds} "
                  f"interleaved rounds | this: {this.cpu_per_event_us:.1f} us CPU/event, "
                  f"{this.cpu_per_request_ms:.3f} ms CPU/request, "
                  f"TTFT p50 {this.ttft_p50():.2f} ms, {this.rate:,.0f} tok/s | other: "
                  f"{other.cpu_per_event_us:.1f} us CPU/event, "
                  f"{other.cpu_per_request_ms:.3f} ms CPU/request, TTFT p50 "
                  f"{other.ttft_p50():.2f} ms, {other.rate:,.0f} tok/s | CPU/event ratio "
                  f"this/other {this.cpu_per_event_us / other.cpu_per_event_us:.3f} | "
                  f"cycle collections per 100 requests "
                  f"{this.collections_per_100_requests:.1f}/"
                  f"{other.collections_per_100_requests:.1f} | "
                  f"errors {this.errors}/{other.errors}", flush=True)
            summary.append(f"{name}: CPU/event x"
                           f"{this.cpu_per_event_us / other.cpu_per_event_us:.3f} "
                           f"({this.cpu_per_event_us:.1f} vs {other.cpu_per_event_us:.1f} us)")
    finally:
        for product in products:
            product.stop()
        for process in processes:
            process.kill()
    print(f"gateway overhead against {other_root}"
          f"{' (local replicas)' if options.local else ''}"
          f"{' (Redis)' if options.redis else ''}: " + "; ".join(summary))


def router_executable(folder: Path) -> Path:
    """vLLM's Rust router from PyPI, in the benchmark's own virtual environment (created
    once under `folder`, which git ignores; never the project's environment). py-spy goes
    in with it, for --profile."""
    executable = folder / "bin" / "vllm-router"
    installed = list(folder.glob(f"lib/python*/site-packages/"
                                 f"vllm_router-{ROUTER_VERSION}.dist-info"))
    print(f"vllm-router {ROUTER_VERSION} and py-spy: the environment in {folder}",
          flush=True)
    if executable.exists() and installed and (folder / "bin" / "py-spy").exists():
        return executable
    if not (folder / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    subprocess.run([str(folder / "bin" / "pip"), "install", "--quiet",
                    "--disable-pip-version-check", f"vllm-router=={ROUTER_VERSION}",
                    "py-spy"], check=True)
    return executable


def start_router(executable: Path, engine_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's router before one engine: round_robin over one worker, its own metrics port
    (two routers on one default port make the second panic), warnings only."""
    port = free_port()
    process = subprocess.Popen(
        [str(executable), "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", engine_url, "--policy", "round_robin",
         "--prometheus-port", str(free_port()), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, process)
    except BaseException:
        process.kill()
        raise
    return process, url


def side_by_side(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """Direct, the gateway (embedded default, and alone in its process unless
    --no-gateway-only) and vLLM's router before the same engines, rounds interleaved;
    one table, then each target of each gateway path against the router."""
    rounds = options.rounds or (1 if options.quick else 6)
    names = options.loads or list(LOADS)
    executable = None if options.no_router else router_executable(Path(options.router_env))
    with contextlib.ExitStack() as stack:
        product = ControlPlane(**extra_env)
        stack.callback(product.stop)
        alone, workers = other_gateways(options, extra_env, stack)
        processes: list[subprocess.Popen[bytes]] = []
        stack.callback(end_processes, processes)
        results: list[tuple[Load, list[Endpoint], list[Side]]] = []
        paced, paced_url = start_engine(10.0, "fake")
        unpaced, unpaced_url = start_engine(0.0, "fast")
        processes += [paced, unpaced]
        endpoints = [Endpoint("direct", {"fake": paced_url, "fast": unpaced_url}, None, {})]
        for label, plane in (("gateway", product), ("gateway alone", alone),
                             (f"gateway, {options.workers} workers", workers)):
            if plane is None:
                continue
            plane.route("fake", paced_url)
            plane.route("fast", unpaced_url)
            pid = plane.process.pid
            endpoints.append(Endpoint(label, {"fake": plane.url, "fast": plane.url},
                                      plane.key, {"fake": pid, "fast": pid}))
        if executable is not None:  # one router per engine, as one gateway serves both
            (paced_router, paced_via), (unpaced_router, unpaced_via) = (
                start_router(executable, url) for url in (paced_url, unpaced_url))
            processes += [paced_router, unpaced_router]
            endpoints.append(Endpoint(ROUTER, {"fake": paced_via, "fast": unpaced_via},
                                      None, {"fake": paced_router.pid,
                                             "fast": unpaced_router.pid}))
        settle(endpoints, [plane for plane in (product, workers) if plane is not None])
        # Background CPU (the gateway's controllers and collector, the routers' health
        # checks), measured once with no traffic, then subtracted in the "net" column.
        idle = idle_burn(endpoints, 10.0)
        print("with no traffic, CPU of one core: " + ", ".join(
            f"{endpoint.name} ({'paced' if model == 'fake' else 'unpaced'}) "
            f"{idle[model][index]:.1%}" for model in idle
            for index, endpoint in enumerate(endpoints) if endpoint.pids), flush=True)
        if alone is not None:
            print(f"the gateway alone's controllers (run_controllers, another process) with "
                  f"no traffic: {controllers_idle(alone, 10.0):.1%} of one "
                  f"core (not counted in its figures)", flush=True)
        for name in names:
            load_ = LOADS.get(name) or profile_load(name)
            sides = interleave(load_, endpoints, rounds, idle[load_.model])
            results.append((load_, endpoints, sides))
            print_rows(load_, endpoints, sides, rounds)
        print_table(results, rounds)
        if options.vllm:
            print("gateway overhead, vLLM: " + "; ".join(measure_vllm(product, processes, 1)))


ROUTER = "vllm-router"


def other_gateways(options: argparse.Namespace, extra_env: dict[str, str],
                   stack: contextlib.ExitStack) -> tuple[GatewayOnly | None,
                                                         GatewayWorkers | None]:
    """The gateway alone (unless --no-gateway-only) and `serve --workers N` (with
    --workers), each with a database of its own on one private Redis, stopped by `stack`."""
    if options.no_gateway_only and not options.workers:
        return None, None
    from tests.services import private_redis

    redis_server = stack.enter_context(private_redis())
    alone = workers = None
    if not options.no_gateway_only:
        alone = GatewayOnly(redis_server.database_url(0), **extra_env)
        stack.callback(alone.stop)
    if options.workers:
        workers = GatewayWorkers(options.workers, redis_server.database_url(1), **extra_env)
        stack.callback(workers.stop)
    return alone, workers


def end_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """Kill the engines and routers (a process group where one was made)."""
    for process in processes:
        if getattr(process, "fleet_group", False):
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()


def controllers_idle(alone: GatewayOnly, seconds: float) -> float:
    """The gateway alone's controllers process: its CPU per second with no traffic."""
    controllers = Endpoint("controllers", {}, None, {"fake": alone.controllers.pid})
    return idle_burn([controllers], seconds)["fake"][0]


def print_rows(load_: Load, endpoints: list[Endpoint], sides: list[Side], rounds: int) -> None:
    """One line per path as each load finishes, so a long run shows progress."""
    direct = sides[0]
    for endpoint, side in zip(endpoints, sides, strict=True):
        print(f"{load_.name} ({load_.streams} x {load_.requests} x {load_.tokens} tokens, "
              f"{rounds} rounds) {endpoint.name}: TTFT p50 {side.ttft(0.5):.2f} p99 "
              f"{side.ttft(0.99):.2f} ms, {side.rate:,.0f} tok/s, ratio "
              f"{side.rate / direct.rate:.3f}, "
              + (f"{side.cpu_per_event_us:.1f} us CPU/event "
                 f"({side.net_cpu_per_event_us:.1f} net of idle), " if endpoint.pids else "")
              + f"burst {side.burst_ms:.1f} ms with the machine {side.burst_cores:.2f} of "
              f"{os.cpu_count()} cores busy, errors {side.errors}", flush=True)


def print_table(results: list[tuple[Load, list[Endpoint], list[Side]]], rounds: int) -> None:
    """The markdown table, then the targets (each gateway path against the router, same
    run)."""
    print(f"\n{rounds} interleaved rounds per load; added TTFT is the path's percentile "
          f"minus the direct one; CPU per relayed event is the path's process (user + "
          f"system, every thread, children included) over its own rounds; net: less its "
          f"CPU with no traffic over as long.\n")
    print("| load | path | TTFT p50 / p99 | added TTFT p50 / p99 | tokens/s | ratio | "
          "CPU per event (net) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    # Per gateway path, per target, the rows that miss it.
    misses: dict[str, dict[str, list[str]]] = {}
    for load_, endpoints, sides in results:
        direct = sides[0]
        for endpoint, side in zip(endpoints, sides, strict=True):
            added = (f"{side.ttft(0.5) - direct.ttft(0.5):+.1f} / "
                     f"{side.ttft(0.99) - direct.ttft(0.99):+.1f} ms"
                     if endpoint.name != "direct" else "")
            cpu = (f"{side.cpu_per_event_us:.1f} µs ({side.net_cpu_per_event_us:.1f})"
                   if endpoint.pids else "")
            print(f"| {load_.name} | {endpoint.name} | {side.ttft(0.5):.1f} / "
                  f"{side.ttft(0.99):.1f} ms | {added} | {side.rate:,.0f} | "
                  f"{side.rate / direct.rate:.3f} | {cpu} | {side.errors} |")
        names = [endpoint.name for endpoint in endpoints]
        if ROUTER not in names:
            continue
        router = sides[names.index(ROUTER)]
        for endpoint, side in zip(endpoints[1:], sides[1:], strict=True):
            if endpoint.name != ROUTER:
                check_targets(load_.name, direct, side, router, misses.setdefault(
                    endpoint.name, {"ttft": [], "ratio": [], "cpu": []}))
    print()
    if not misses:
        print("targets: not judged (no vllm-router in this run)")
        return
    rows = len(results)
    for path, missed in misses.items():
        for key, text in (("ttft", "added TTFT p50 within the router's + 2 ms on every row"),
                          ("ratio", "throughput ratio at least the router's on every row"),
                          ("cpu", "CPU per relayed event at most the router's on every row")):
            verdict = "MISSED" if missed[key] else "met"
            detail = "; ".join(missed[key]) if missed[key] else f"{rows} of {rows} rows"
            print(f"target ({path}): {text}: {verdict} ({detail})")


def check_targets(name: str, direct: Side, gateway: Side, router: Side,
                  misses: dict[str, list[str]]) -> None:
    """Adds this row to `misses` for each target of the gateway it misses."""
    gateway_added = gateway.ttft(0.5) - direct.ttft(0.5)
    router_added = router.ttft(0.5) - direct.ttft(0.5)
    if gateway_added > router_added + 2.0:
        misses["ttft"].append(f"{name}: {gateway_added:+.1f} against {router_added:+.1f} ms")
    if gateway.rate < router.rate:
        misses["ratio"].append(f"{name}: {gateway.rate / direct.rate:.4f} against "
                               f"{router.rate / direct.rate:.4f}")
    if gateway.cpu_per_event_us > router.cpu_per_event_us:
        misses["cpu"].append(f"{name}: {gateway.cpu_per_event_us:.1f} against "
                             f"{router.cpu_per_event_us:.1f} µs")


def start_vllm(*, eager: bool) -> tuple[subprocess.Popen[bytes], str]:
    """The real vLLM CPU server with the demo model (converted once more here), in its own
    process group; compiled mode unless `eager`."""
    from models_registry.demo import demo_gguf_path
    from models_registry.importers import convert_gguf

    folder = Path(tempfile.mkdtemp(prefix="bench-model-")) / "smollm2"
    convert_gguf(demo_gguf_path(), folder, lambda percent, stage: None)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
         "--served-model-name", "smollm2", "--port", str(port), "--max-model-len", "2048",
         "--disable-uvicorn-access-log", *(["--enforce-eager"] if eager else [])],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 900, process)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process, url


def measure_vllm(product: ControlPlane, processes: list[subprocess.Popen[bytes]],
                 rounds: int) -> list[str]:
    process, url = start_vllm(eager=False)
    process.fleet_group = True  # type: ignore[attr-defined]
    product.route("smollm2", url)
    results = []
    for streams in (1, 32):
        direct, through = compare("vLLM CPU, demo model", url, product.url, "smollm2",
                                  streams, 128, product.key, 1)
        results.append(f"vLLM {streams}: +{through.p(0.5) - direct.p(0.5):.1f} ms, "
                       f"x{through.rate / direct.rate:.3f}")
    return results


def profile_gateway(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """py-spy on the gateway process while --profile-load goes through it (128 paced
    streams unless told): every thread's active stacks, 100 a second, as raw collapsed
    stacks into --profile; then where the time goes, and the gateway's CPU per request and
    per event over one round of the same load without the sampler."""
    py_spy = router_executable(Path(options.router_env)).parent / "py-spy"
    load_ = options.profile_load
    product = ControlPlane(**extra_env)
    engine: subprocess.Popen[bytes] | None = None
    stop = threading.Event()
    try:
        engine, engine_url = start_engine(10.0 if load_.model == "fake" else 0.0, load_.model)
        product.route(load_.model, engine_url)
        url, model, key = product.url, load_.model, product.key
        asyncio.run(load(url, model, load_.streams, 1, key, 1))  # warm pools

        def drive() -> None:
            while not stop.is_set():
                asyncio.run(load(url, model, load_.streams, load_.tokens, key, load_.requests))

        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        time.sleep(2)  # let the streams reach their steady state first
        gateway = Endpoint("gateway", {}, None, {model: product.process.pid})
        before, started = gateway.cpu_seconds(model), time.monotonic()
        subprocess.run([str(py_spy), "record", "--pid", str(product.process.pid),
                        "--duration", str(options.profile_seconds), "--rate", "100",
                        "--format", "raw", "--threads",
                        # C frames (uvloop, the interpreter) need the process paused.
                        *(["--native"] if options.profile_native else ["--nonblocking"]),
                        "--output", options.profile], check=True,
                       stdout=subprocess.DEVNULL)
        busy = (gateway.cpu_seconds(model) - before) / (time.monotonic() - started)
        stop.set()
        driver.join(timeout=60)
        unsampled = interleave(load_, [replace(gateway, urls={model: url}, key=key)], 1)[0]
    finally:
        stop.set()
        product.stop()
        if engine is not None:
            engine.kill()
    print(f"{load_.name}: gateway process CPU while sampled: {busy:.0%} of one core; "
          f"without the sampler, {unsampled.cpu_per_request_ms:.3f} ms per request, "
          f"{unsampled.cpu_per_event_us:.1f} us per event ({unsampled.requests} requests, "
          f"{unsampled.events} events)")
    print(summarize_profile(Path(options.profile), options.profile_seconds))


def profile_idle(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """py-spy on the gateway process with no traffic at all (the embedded controllers,
    collector and load watcher, two external deployments of fake engines routed): every
    thread's active stacks, 1,000 a second for --profile-seconds, into --profile; then its
    CPU over the window and where the time goes."""
    py_spy = router_executable(Path(options.router_env)).parent / "py-spy"
    product = ControlPlane(**extra_env)
    engines: list[subprocess.Popen[bytes]] = []
    try:
        for model, interval in (("fake", 10.0), ("fast", 0.0)):
            engine, engine_url = start_engine(interval, model)
            engines.append(engine)
            product.route(model, engine_url)
        time.sleep(10)  # past the first passes that follow the routes' creation
        gateway = Endpoint("gateway", {}, None, {"fake": product.process.pid})
        before, started = gateway.cpu_seconds("fake"), time.monotonic()
        subprocess.run([str(py_spy), "record", "--pid", str(product.process.pid),
                        "--duration", str(options.profile_seconds), "--rate", "1000",
                        "--format", "raw", "--threads", "--nonblocking",
                        "--output", options.profile], check=True, stdout=subprocess.DEVNULL)
        busy = (gateway.cpu_seconds("fake") - before) / (time.monotonic() - started)
    finally:
        product.stop()
        for engine in engines:
            engine.kill()
    print(f"idle: gateway process CPU while sampled: {busy:.2%} of one core")
    print(summarize_profile(Path(options.profile), options.profile_seconds, 1000))


def profile_load(text: str) -> Load:
    """`--profile-load (paced|unpaced)-STREAMS[xTOKENS]`, e.g. paced-128 or unpaced-128x1."""
    match = re.fullmatch(r"(paced|unpaced)-(\d+)(?:x(\d+))?", text.strip())
    if not match or int(match.group(2)) < 1 or int(match.group(3) or 256) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected paced-N or unpaced-N, "
                                         f"optionally xTOKENS (e.g. unpaced-128x1)")
    paced, streams, tokens = match.group(1) == "paced", int(match.group(2)), int(
        match.group(3) or 256)
    # A round of about a second or more, so the unsampled figure is not a few ms long.
    requests = 1 if paced else max(1, 256 * 64 * 8 // (streams * tokens))
    requests = min(requests, max(1, 4096 // streams))
    return Load(text, "paced 10 ms/token" if paced else "unpaced", "fake" if paced else "fast",
                streams, requests, tokens)


def load_names(text: str) -> list[str]:
    """`--loads paced-128,unpaced-64`: names from LOADS, or (for --compare-with) any load
    --profile-load takes, e.g. unpaced-128x1; refused otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOADS
               and not re.fullmatch(r"(paced|unpaced)-\d+(x\d+)?", name)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown load {', '.join(unknown) or text!r}; "
                                         f"known: {', '.join(LOADS)}, or (paced|unpaced)-"
                                         f"STREAMS[xTOKENS] with --compare-with")
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true", help="also measure the real vLLM CPU "
                        "server with the demo model, direct and through the gateway (starts "
                        "one, about 2 minutes)")
    parser.add_argument("--quick", action="store_true", help="one round per load")
    parser.add_argument("--loads", type=load_names, metavar="NAME,...",
                        help=f"a subset of the loads ({', '.join(LOADS)}); default all")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per load (default 6, "
                        "1 with --quick; 4 and 2 with --compare-with)")
    parser.add_argument("--no-router", action="store_true",
                        help="direct and the gateway only (no vllm-router)")
    parser.add_argument("--no-gateway-only", action="store_true",
                        help="leave out the gateway alone in its process (serve "
                        "--no-controllers beside run_controllers, on a private Redis)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="also `serve --workers N` (N gateway processes on one port, "
                        "the controllers once; on the private Redis), judged like the others")
    parser.add_argument("--router-env", default=str(ROUTER_ENV), metavar="PATH",
                        help="the benchmark's own environment holding vllm-router and "
                        "py-spy, created there on first use (default %(default)s)")
    parser.add_argument("--profile", metavar="PATH", help="instead of the table: py-spy "
                        "samples the gateway under --profile-load into PATH (raw "
                        "collapsed stacks) and prints where its time goes")
    parser.add_argument("--profile-seconds", type=int, default=20)
    parser.add_argument("--profile-load", type=profile_load, default=profile_load("paced-128"),
                        metavar="paced-N|unpaced-N[xTOKENS]", help="with --profile: the load "
                        "(default paced-128; unpaced-128x1 is nearly all per-request work)")
    parser.add_argument("--profile-idle", action="store_true", help="with --profile: the "
                        "gateway with no traffic (its background), sampled 1,000 a second")
    parser.add_argument("--profile-native", action="store_true", help="with --profile: C "
                        "frames too (uvloop, the interpreter); pauses the gateway per sample")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the control plane under test")
    parser.add_argument("--compare-with", metavar="PATH", help="another checkout of the "
                        "project: its gateway against this one's, in interleaved rounds")
    parser.add_argument("--redis", action="store_true", help="with --compare-with: each "
                        "control plane with REDIS_URL (a database each on a private Redis): "
                        "rate limits and the route table in Redis, as for the gateway alone")
    parser.add_argument("--local", action="store_true", help="with --compare-with: the "
                        "engines are replicas each control plane runs (their chunks carry "
                        "the usage so far, which the gateway takes out)")
    options = parser.parse_args()
    if options.rounds is not None and options.rounds < 1:
        parser.error("--rounds must be at least 1")
    if options.workers == 1 or options.workers < 0:
        parser.error("--workers takes 2 or more")
    if options.profile_idle and not options.profile:
        parser.error("--profile-idle goes with --profile")
    if options.redis and not options.compare_with:
        parser.error("--redis goes with --compare-with")
    if options.local and not options.compare_with:
        parser.error("--local goes with --compare-with")
    extra_env = dict(item.split("=", 1) for item in options.env)
    if options.compare_with:
        compare_checkouts(options, extra_env)
    elif options.profile and options.profile_idle:
        profile_idle(options, extra_env)
    elif options.profile:
        profile_gateway(options, extra_env)
    else:
        side_by_side(options, extra_env)


if __name__ == "__main__":
    main()
