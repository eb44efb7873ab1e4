"""bench/gateway_overhead.py --profile PATH: py-spy (from the benchmark's environment)
samples the gateway process under --profile-load, or with --profile-idle with no traffic
at all (its background: controllers, collector, load watcher), writes the raw collapsed
stacks to PATH and prints where the time goes (bench/profile_summary.py)."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import router_executable  # noqa: E402
from bench.path_figures import Endpoint, interleave  # noqa: E402
from bench.planes import ControlPlane, start_engine  # noqa: E402
from bench.profile_summary import summarize_profile  # noqa: E402
from bench.stream_load import load  # noqa: E402


def profile_gateway(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """py-spy on the gateway process while --profile-load goes through it (128 paced
    streams unless told): every thread's active stacks, 100 a second (--profile-rate), as
    raw collapsed stacks into --profile; then where the time goes, and the gateway's CPU
    per request and per event over one round of the same load without the sampler."""
    py_spy = router_executable(Path(options.router_env)).parent / "py-spy"
    rate = options.profile_rate or 100
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
        before, started = gateway.cpu_reading(model), time.monotonic()
        subprocess.run([str(py_spy), "record", "--pid", str(product.process.pid),
                        "--duration", str(options.profile_seconds), "--rate", str(rate),
                        "--format", "raw", "--threads",
                        # C frames (uvloop, the interpreter) need the process paused.
                        *(["--native"] if options.profile_native else ["--nonblocking"]),
                        "--output", options.profile], check=True,
                       stdout=subprocess.DEVNULL)
        busy = gateway.cpu_reading(model).since(before) / (time.monotonic() - started)
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
    print(summarize_profile(Path(options.profile), options.profile_seconds, rate))


def profile_idle(options: argparse.Namespace, extra_env: dict[str, str]) -> None:
    """py-spy on the gateway process with no traffic at all (the embedded controllers,
    collector and load watcher, two external deployments of fake engines routed): every
    thread's active stacks, 1,000 a second (--profile-rate) for --profile-seconds, into
    --profile; then its CPU over the window and where the time goes."""
    py_spy = router_executable(Path(options.router_env)).parent / "py-spy"
    rate = options.profile_rate or 1000
    product = ControlPlane(**extra_env)
    engines: list[subprocess.Popen[bytes]] = []
    try:
        for model, interval in (("fake", 10.0), ("fast", 0.0)):
            engine, engine_url = start_engine(interval, model)
            engines.append(engine)
            product.route(model, engine_url)
        time.sleep(10)  # past the first passes that follow the routes' creation
        gateway = Endpoint("gateway", {}, None, {"fake": product.process.pid})
        before, started = gateway.cpu_reading("fake"), time.monotonic()
        subprocess.run([str(py_spy), "record", "--pid", str(product.process.pid),
                        "--duration", str(options.profile_seconds), "--rate", str(rate),
                        "--format", "raw", "--threads", "--nonblocking",
                        "--output", options.profile], check=True, stdout=subprocess.DEVNULL)
        busy = gateway.cpu_reading("fake").since(before) / (time.monotonic() - started)
    finally:
        product.stop()
        for engine in engines:
            engine.kill()
    print(f"idle: gateway process CPU while sampled: {busy:.2%} of one core")
    print(summarize_profile(Path(options.profile), options.profile_seconds, rate))
