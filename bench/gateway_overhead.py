"""Gateway overhead: the same load sent straight to an engine and through the gateway, side
by side, in one run.

- paced: the FAKE engine (fakes/engine.py) emitting one token every 10 ms, 1, 16 and 128
  concurrent streams of 256 tokens: added TTFT p50/p99 and the throughput ratio;
- unpaced: the fake engine as fast as it can, 64 streams: the throughput ratio;
- with --vllm: the real vLLM CPU server with the demo model, 1 and 32 streams.

Direct and gateway runs alternate round by round (direct, gateway, direct, gateway ...).

The gateway is the product itself (`manage.py serve`, controllers included) with the engine
registered as an external deployment. Everything runs on this machine: engine, gateway and
load client share its cores.

With --compare-with PATH (another checkout of the project, e.g. a `git worktree` of an
older commit with the same .venv), a second server runs that checkout's code before the
same engines, and each load is sent to the two in interleaved rounds (A, B, A, B) so both
see the same machine. Besides TTFT and throughput it prints each server's CPU time per
relayed event (the server process's user + system seconds over the events the client
received; the least noisy figure on a shared machine) and their ratio.

    .venv/bin/python bench/gateway_overhead.py [--vllm] [--quick] [--compare-with PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.processes import (  # noqa: E402
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)


@dataclass
class Run:
    ttfts: list[float]
    tokens: int
    seconds: float
    errors: int

    def p(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


async def load(url: str, model: str, streams: int, tokens: int, key: str | None,
               rounds: int) -> Run:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "Count with me:", "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    ttfts: list[float] = []
    counted = 0
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal counted, errors
            for _ in range(rounds):
                started = time.perf_counter()
                first = None
                try:
                    async with session.post(f"{url}/v1/completions", json=body,
                                            headers=headers) as response:
                        if response.status != 200:
                            errors += 1
                            if errors == 1:
                                print(f"{url}: HTTP {response.status} "
                                      f"{(await response.read())[:300]!r}", flush=True)
                            else:
                                await response.read()
                            continue
                        async for line in response.content:
                            if not line.startswith(b"data: {"):
                                continue
                            if first is None:
                                first = time.perf_counter() - started
                            if b'"choices":[]' not in line:
                                counted += 1
                except aiohttp.ClientError:
                    errors += 1
                if first is not None:
                    ttfts.append(first)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        seconds = time.perf_counter() - started
    return Run(ttfts, counted, seconds, errors)


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

    def __init__(self, **extra_env: str) -> None:
        data = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        root = self.root
        self.env = server_env(data / "data", LOG_LEVEL="WARNING", **extra_env)
        self.manage("migrate", "--noinput", "-v0")
        self.admin = self.manage("create_api_key", "--name", "bench", "--scope",
                                 "admin").stdout.strip().splitlines()[-1]
        self.key = self.manage("create_api_key", "--name", "load", "--scope",
                               "inference").stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if root == ROOT:
            self.process, _ = start_server(self.env, self.port)
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
        stop_server(self.process)


class OtherCheckout(ControlPlane):
    """The control plane of another checkout of the project (its code, the same venv)."""

    def __init__(self, root: Path, extra_env: dict[str, str]) -> None:
        self.root = root
        super().__init__(**extra_env)


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


@dataclass
class Side:
    """One server's figures over the interleaved rounds of one load."""

    runs: list[Run]
    cpu: float  # seconds of the server's CPU

    @property
    def events(self) -> int:
        """Events relayed over every round."""
        return sum(run.tokens for run in self.runs)

    @property
    def cpu_per_event_us(self) -> float:
        """Microseconds of the server's CPU per relayed event."""
        return self.cpu / max(1, self.events) * 1e6

    def ttft_p50(self) -> float:
        """TTFT p50 over every round, in ms."""
        return Run([t for run in self.runs for t in run.ttfts], 0, 1, 0).p(0.5)

    @property
    def rate(self) -> float:
        """Tokens per second over every round."""
        return sum(run.tokens for run in self.runs) / sum(run.seconds for run in self.runs)


def interleave(label: str, products: list[ControlPlane], model: str, streams: int, tokens: int,
               rounds: int) -> list[Side]:
    """The same load sent to each product in turn, `rounds` times (A, B, A, B)."""
    for product in products:  # warm connection pools at the measured concurrency
        asyncio.run(load(product.url, model, streams, 8, product.key, 1))
    sides = [Side([], 0.0) for _ in products]
    for _ in range(rounds):
        for product, side in zip(products, sides, strict=True):
            before = product.cpu_seconds()
            side.runs.append(asyncio.run(load(product.url, model, streams, tokens,
                                              product.key, 1)))
            side.cpu += product.cpu_seconds() - before
    this, other = sides[0], sides[1]
    print(f"{label}: {streams} streams x {tokens} tokens, {rounds} interleaved rounds | "
          f"this: {this.cpu_per_event_us:.1f} us CPU/event, TTFT p50 "
          f"{this.ttft_p50():.2f} ms, {this.rate:,.0f} tok/s | other: "
          f"{other.cpu_per_event_us:.1f} us CPU/event, TTFT p50 {other.ttft_p50():.2f} ms, "
          f"{other.rate:,.0f} tok/s | CPU/event ratio this/other "
          f"{this.cpu_per_event_us / other.cpu_per_event_us:.3f} | errors "
          f"{sum(r.errors for r in this.runs)}/{sum(r.errors for r in other.runs)}",
          flush=True)
    return sides


def compare_checkouts(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """This checkout's gateway against another's, in interleaved rounds."""
    other_root = Path(options.compare_with).resolve()
    rounds = 2 if options.quick else 4
    products = [ControlPlane(**extra_env), OtherCheckout(other_root, extra_env)]
    processes: list[subprocess.Popen[bytes]] = []
    summary: list[str] = []
    try:
        paced, paced_url = start_engine(10.0, "fake")
        unpaced, unpaced_url = start_engine(0.0, "fast")
        processes += [paced, unpaced]
        for product in products:
            product.route("fake", paced_url)
            product.route("fast", unpaced_url)
        loads = [("paced 10 ms/token", "fake", 16, 256), ("unpaced", "fast", 64, 256)]
        if not options.quick:
            loads.insert(0, ("paced 10 ms/token", "fake", 1, 256))
        for label, model, streams, tokens in loads:
            this, other = interleave(label, products, model, streams, tokens, rounds)
            summary.append(f"{label} {streams}: CPU/event x"
                           f"{this.cpu_per_event_us / other.cpu_per_event_us:.3f} "
                           f"({this.cpu_per_event_us:.1f} vs {other.cpu_per_event_us:.1f} us)")
    finally:
        for product in products:
            product.stop()
        for process in processes:
            process.kill()
    print(f"gateway overhead against {other_root}: " + "; ".join(summary))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true", help="also measure the real vLLM CPU "
                        "server with the demo model (starts one, about 2 minutes)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the control plane under test")
    parser.add_argument("--compare-with", metavar="PATH", help="another checkout of the "
                        "project: its gateway against this one's, in interleaved rounds")
    options = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in options.env)
    if options.compare_with:
        compare_checkouts(options, extra_env)
        return
    rounds = 1 if options.quick else 3
    product = ControlPlane(**extra_env)
    processes: list[subprocess.Popen[bytes]] = []
    summary: list[str] = []
    try:
        paced, paced_url = start_engine(10.0, "fake")
        unpaced, unpaced_url = start_engine(0.0, "fast")
        processes += [paced, unpaced]
        product.route("fake", paced_url)
        product.route("fast", unpaced_url)
        for streams in (1, 16, 128):
            direct, through = compare("paced 10 ms/token", paced_url, product.url, "fake",
                                      streams, 256, product.key, rounds)
            summary.append(f"paced {streams}: +{through.p(0.5) - direct.p(0.5):.2f}/"
                           f"+{through.p(0.99) - direct.p(0.99):.2f} ms, "
                           f"x{through.rate / direct.rate:.3f}")
        direct, through = compare("unpaced", unpaced_url, product.url, "fast", 64, 256,
                                  product.key, rounds)
        summary.append(f"unpaced 64: x{through.rate / direct.rate:.3f}")
        if options.vllm:
            summary += measure_vllm(product, processes, rounds)
    finally:
        product.stop()
        for process in processes:
            with_group = getattr(process, "fleet_group", False)
            if with_group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
    print("gateway overhead: " + "; ".join(summary))


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


if __name__ == "__main__":
    main()
