"""bench/gateway_overhead.py --compare-with PATH: this checkout's gateway against another
checkout's (e.g. a `git worktree` of an older commit with the same .venv), each `manage.py
serve` before the same engines, every load sent to the two in interleaved rounds (A, B,
A, B). Per load: each server's CPU per relayed event and per request, TTFT p50 and its
legs (bench/stream_load.py), tokens/s, their CPU ratio (on the last line also the mean
per-round difference ± two standard errors, and whether the rounds tell it apart from
their own scatter: bench/spread.py), and how often each server's cycle collector ran per
100 requests (python_gc_collections_total on its /metrics, read around
each of its rounds). With --local, the engines are replicas each control plane runs
itself; with --redis, each control plane has REDIS_URL (a database each on a private
Redis). With --other-python, the other checkout runs under that interpreter
(`--compare-with . --other-python PATH`: this code under two interpreters); with
--other-env NAME=VALUE, with that setting (`--compare-with . --other-env NAME=VALUE`:
this code with and without it).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.path_figures import LOADS, Endpoint, interleave, legs_text, profile_load  # noqa: E402
from bench.planes import ENGINE_KEEP_ALIVE, ControlPlane, start_engine  # noqa: E402
from bench.spread import describe, paired, round_cpu_us  # noqa: E402
from fakes.vllm_cli import stand_in_python  # noqa: E402


class OtherCheckout(ControlPlane):
    """The control plane of another checkout of the project (its code, this venv unless
    another interpreter is given)."""

    def __init__(self, root: Path, extra_env: dict[str, str], python: str | None = None
                 ) -> None:
        self.root = root
        self.python = python or sys.executable
        super().__init__(**extra_env)


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
        envs[1] = {**envs[1], **options.other_env}
        compare_two(options, other_root, envs, pythons)


def compare_two(options: argparse.Namespace, other_root: Path, envs: list[dict[str, str]],
                pythons: dict[str, str]) -> None:
    """The body of compare_checkouts: each control plane with its own settings."""
    rounds = options.rounds or (2 if options.quick else 4)
    names = options.loads or ["paced-1", "paced-16", "unpaced-64"]
    products = [ControlPlane(**envs[0]),
                OtherCheckout(other_root, envs[1], options.other_python)]
    processes: list[subprocess.Popen[bytes]] = []
    summary: list[str] = []
    try:
        if options.local:
            for product in products:
                for model, python in pythons.items():
                    product.run_locally(model, python)
        else:
            keep_alive = options.engine_keep_alive or ENGINE_KEEP_ALIVE
            paced, paced_url = start_engine(10.0, "fake", keep_alive)
            unpaced, unpaced_url = start_engine(0.0, "fast", keep_alive)
            processes += [paced, unpaced]
            for product in products:
                product.route("fake", paced_url)
                product.route("fast", unpaced_url)
        endpoints = [Endpoint(name, {"fake": p.url, "fast": p.url}, p.key,
                              {"fake": p.process.pid, "fast": p.process.pid},
                              f"{p.url}/metrics", p.database)
                     for name, p in zip(("this", "other"), products, strict=True)]
        for name in names:
            load_ = LOADS.get(name) or profile_load(name)
            this, other = interleave(load_, endpoints, rounds)
            print(f"{name}: {load_.streams} streams x {load_.tokens} tokens, {rounds} "
                  f"interleaved rounds | this: {this.cpu_per_event_us:.1f} us CPU/event, "
                  f"{this.cpu_per_request_ms:.3f} ms CPU/request, "
                  f"TTFT p50 {this.ttft_p50():.2f} ms, {legs_text(this)}{this.rate:,.0f} "
                  f"tok/s | other: {other.cpu_per_event_us:.1f} us CPU/event, "
                  f"{other.cpu_per_request_ms:.3f} ms CPU/request, TTFT p50 "
                  f"{other.ttft_p50():.2f} ms, {legs_text(other)}{other.rate:,.0f} tok/s | "
                  f"CPU/event ratio "
                  f"this/other {this.cpu_per_event_us / other.cpu_per_event_us:.3f} | "
                  f"cycle collections per 100 requests "
                  f"{this.collections_per_100_requests:.1f}/"
                  f"{other.collections_per_100_requests:.1f} | "
                  f"errors {this.errors}/{other.errors}", flush=True)
            spread = paired(round_cpu_us(this), round_cpu_us(other))
            summary.append(f"{name}: CPU/event x"
                           f"{this.cpu_per_event_us / other.cpu_per_event_us:.3f} "
                           f"({this.cpu_per_event_us:.1f} vs {other.cpu_per_event_us:.1f} us"
                           f"{describe(spread, 1, ' us')})")
    finally:
        for product in products:
            product.stop()
        for process in processes:
            process.kill()
    settings = " ".join(f"{name}={value}" for name, value in options.other_env.items())
    print(f"gateway overhead against {other_root}"
          f"{f' under {options.other_python}' if options.other_python else ''}"
          f"{f' with {settings}' if settings else ''}"
          f"{' (local replicas)' if options.local else ''}"
          f"{' (Redis)' if options.redis else ''}: " + "; ".join(summary))
