"""Gateway overhead: the same load sent straight to an engine and through the gateway, side
by side, in one run.

- paced: the FAKE engine (fakes/engine.py) emitting one token every 10 ms, 1, 16 and 128
  concurrent streams of 256 tokens: added TTFT p50/p99 and the throughput ratio;
- unpaced: the fake engine as fast as it can, 64 streams: the throughput ratio;
- with --vllm: the real vLLM CPU server with the demo model, 1 and 32 streams.

The gateway is the product itself (`manage.py serve`, controllers included) with the engine
registered as an external deployment. Everything runs on this machine: engine, gateway and
load client share its cores.

    .venv/bin/python bench/gateway_overhead.py [--vllm] [--quick]
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

from tests.product import (  # noqa: E402
    free_port,
    manage,
    product_env,
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
    direct = asyncio.run(load(direct_url, model, streams, tokens, None, rounds))
    through = asyncio.run(load(gateway_url, model, streams, tokens, key, rounds))
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


class Product:
    """The control plane, with engines registered as external deployments."""

    def __init__(self, **extra_env: str) -> None:
        data = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        self.env = product_env(data / "data", LOG_LEVEL="WARNING", **extra_env)
        manage(self.env, "migrate", "--noinput", "-v0")
        self.admin = manage(self.env, "create_api_key", "--name", "bench", "--scope",
                            "admin").stdout.strip().splitlines()[-1]
        self.key = manage(self.env, "create_api_key", "--name", "load", "--scope",
                          "inference").stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process, _ = start_server(self.env, self.port)

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true", help="also measure the real vLLM CPU "
                        "server with the demo model (starts one, about 2 minutes)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the control plane under test")
    options = parser.parse_args()
    rounds = 1 if options.quick else 3
    product = Product(**dict(item.split("=", 1) for item in options.env))
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


def measure_vllm(product: Product, processes: list[subprocess.Popen[bytes]],
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
