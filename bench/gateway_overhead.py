"""Gateway overhead: the same load sent straight to the engines, through the gateway and
through vLLM's Rust router (`vllm-router` from PyPI), side by side, in one run.

The loads (--loads picks a subset, --rounds sets how many interleaved rounds):
- paced-1, paced-16, paced-128: the FAKE engine (fakes/engine.py) emitting one token every
  10 ms, 1, 16 and 128 concurrent streams of 256 tokens;
- unpaced-1, unpaced-64: the fake engine as fast as it can, 1 and 64 streams, the
  streams taking turns a token each, as a batching engine's do (--serial-engine: each
  stream's tokens back to back, whole streams one after another);
- with --vllm: afterwards the real vLLM CPU server with the demo model, 1 and 32 streams,
  direct and through the gateway.

The gateway is the product itself (`manage.py serve`, controllers included) with each
engine registered as an external deployment; unless --no-gateway-only, also alone in its
process (`serve --no-controllers` beside `run_controllers`, sharing the database and a
private `redis-server`), its CPU counted without the controllers'. The load key has rate
limits no load reaches, so the limiter is in the measured path (in Redis for the gateway
alone). The router runs round_robin over one worker,
one router per engine, from the benchmark's own virtual environment (.bench/router-venv,
ignored by git, created on first use; never the project's). Rounds are interleaved, each
beginning one path later than the last (direct, gateway, router, then gateway, router,
direct, ...), so every path sees the same machine. Per path and load it
prints TTFT p50/p99, the added TTFT against direct, the throughput ratio to direct and the
CPU time per relayed event of the relaying process (each thread's time on a CPU by the
scheduler's own count, in nanoseconds, /proc/PID/task/TID/schedstat; psutil's user +
system seconds, which Linux gives in 10 ms ticks, where a thread ended meanwhile or on
another system; every thread, over the events the client received in that path's rounds;
the least noisy figure on a shared machine), also net of the process's CPU with no traffic,
how long its threads waited for a CPU per event (runnable but not yet running: the
machine's other processes held the cores, or an idle core was still waking; the same
file's count), and each round's burst: from its start until every stream had its first
token, with how many cores the whole machine kept busy meanwhile (whether a burst's TTFT
waits for a full machine or for one busy process), and the engine's own mean gap between
two tokens of a stream over that path's rounds (its vllm:inter_token_latency_seconds: a
paced engine waits one interval after each token, so a late wake-up lengthens the stream
and lowers the path's throughput ratio however quick the relay);
then one markdown table and, on the last lines, each target of the gateway against the
router (added TTFT p50 within the router's + 2 ms, throughput ratio at least the router's,
CPU per event at most the router's) met or missed; a missed target also gives the mean
per-round difference from the router's same round ± two standard errors, and
whether the run tells that gap apart from its rounds' scatter (bench/spread.py). With
--bare-relay, also a bare byte relay on uvloop before each engine (bench/bare_relay.py:
no parsing, no key, no limit), the least a Python relay can cost per event, as a floor; no
target is judged for it.

With --compare-with PATH, this checkout's gateway against another checkout's instead
(bench/gateway_compare.py); with --profile PATH, py-spy on the gateway under a load or,
with --profile-idle, with no traffic (bench/gateway_profile.py). The loads, the paths'
figures and the printed table are in bench/path_figures.py; the engines and the control
planes it starts in bench/planes.py.

    .venv/bin/python bench/gateway_overhead.py [--loads NAME,...] [--rounds N] [--quick]
        [--no-router] [--no-gateway-only] [--workers N] [--bare-relay] [--serial-engine]
        [--vllm]
        [--compare-with PATH [--local] [--redis] [--engine-keep-alive SECONDS]
                             [--other-python PATH] [--other-env NAME=VALUE ...]]
        [--profile PATH [--profile-native | --profile-idle]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.path_figures import (  # noqa: E402
    BARE,
    LOADS,
    ROUTER,
    Endpoint,
    Load,
    Side,
    idle_burn,
    interleave,
    load_names,
    print_rows,
    print_table,
    profile_load,
)
from bench.planes import (  # noqa: E402
    ControlPlane,
    GatewayOnly,
    GatewayWorkers,
    settings_given,
    start_bare_relay,
    start_engine,
    start_vllm,
)
from bench.stream_load import load  # noqa: E402
from bench.usage_waits import integrity  # noqa: E402
from tests.processes import (  # noqa: E402
    free_port,
    wait_healthy,
)

ROUTER_VERSION = "0.1.17"
ROUTER_ENV = ROOT / ".bench" / "router-venv"


def compare(label: str, direct_url: str, gateway_url: str, model: str, streams: int,
            tokens: int, key: str, rounds: int) -> tuple[Side, Side]:
    """Direct and through the gateway, in interleaved rounds (path_figures.interleave:
    warm pools first, then each round beginning one path later)."""
    endpoints = [Endpoint("direct", {model: direct_url}, None, {}),
                 Endpoint("gateway", {model: gateway_url}, key, {})]
    direct, through = interleave(Load(label, label, model, streams, 1, tokens), endpoints,
                                 rounds)
    print(f"{label}: {streams} streams x {tokens} tokens | direct TTFT p50 "
          f"{direct.ttft(0.5):.2f} ms p99 {direct.ttft(0.99):.2f} ms, {direct.rate:,.0f} tok/s"
          f" | gateway TTFT p50 {through.ttft(0.5):.2f} ms p99 {through.ttft(0.99):.2f} ms, "
          f"{through.rate:,.0f} tok/s | added TTFT p50 "
          f"{through.ttft(0.5) - direct.ttft(0.5):+.2f} ms p99 "
          f"{through.ttft(0.99) - direct.ttft(0.99):+.2f} ms | ratio "
          f"{through.rate / direct.rate:.3f} | errors {direct.errors}/{through.errors}",
          flush=True)
    return direct, through


def settle(endpoints: list[Endpoint]) -> None:
    """Before anything is measured: a request down every path (each one's first
    connections opened, its first-request work done)."""
    for endpoint in endpoints:
        for model, url in endpoint.urls.items():
            asyncio.run(load(url, model, 1, 8, endpoint.key, 1))


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
        unpaced, unpaced_url = start_engine(0.0, "fast", serial=options.serial_engine)
        processes += [paced, unpaced]
        print("the unpaced engine: " + ("whole streams one after another (--serial-engine)"
                                        if options.serial_engine else
                                        "the streams take turns, a token each"), flush=True)
        endpoints = [Endpoint("direct", {"fake": paced_url, "fast": unpaced_url}, None, {})]
        for label, plane in (("gateway", product), ("gateway alone", alone),
                             (f"gateway, {options.workers} workers", workers)):
            if plane is None:
                continue
            plane.route("fake", paced_url)
            plane.route("fast", unpaced_url)
            pid = plane.process.pid
            endpoints.append(Endpoint(label, {"fake": plane.url, "fast": plane.url},
                                      plane.key, {"fake": pid, "fast": pid},
                                      database=plane.database))
        if executable is not None:  # one router per engine, as one gateway serves both
            (paced_router, paced_via), (unpaced_router, unpaced_via) = (
                start_router(executable, url) for url in (paced_url, unpaced_url))
            processes += [paced_router, unpaced_router]
            endpoints.append(Endpoint(ROUTER, {"fake": paced_via, "fast": unpaced_via},
                                      None, {"fake": paced_router.pid,
                                             "fast": unpaced_router.pid}))
        if options.bare_relay:
            (paced_relay, paced_bare), (unpaced_relay, unpaced_bare) = (
                start_bare_relay(url) for url in (paced_url, unpaced_url))
            processes += [paced_relay, unpaced_relay]
            endpoints.append(Endpoint(BARE, {"fake": paced_bare, "fast": unpaced_bare},
                                      None, {"fake": paced_relay.pid,
                                             "fast": unpaced_relay.pid}))
        settle(endpoints)
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
            sides = interleave(load_, endpoints, rounds, idle[load_.model],
                               engines=endpoints[0].urls)  # direct: the engines
            results.append((load_, endpoints, sides))
            print_rows(load_, endpoints, sides, rounds)
        print_table(results, rounds)
        check_databases(endpoints)
        if options.vllm:
            print("gateway overhead, vLLM: " + "; ".join(measure_vllm(product, processes, 1)))


def check_databases(endpoints: list[Endpoint]) -> None:
    """SQLite's check of each control plane's database after the rounds, printed; the run
    fails where one is damaged (processes sharing a database must never corrupt it)."""
    checked = {endpoint.name: integrity(endpoint.database) for endpoint in endpoints
               if endpoint.database is not None and endpoint.database.is_file()}
    if checked:
        print("databases after the rounds (PRAGMA quick_check): " + ", ".join(
            f"{name} {verdict}" for name, verdict in checked.items()), flush=True)
    damaged = [name for name, verdict in checked.items() if verdict != "ok"]
    if damaged:
        raise SystemExit(f"damaged database: {', '.join(damaged)}")


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


def measure_vllm(product: ControlPlane, processes: list[subprocess.Popen[bytes]],
                 rounds: int) -> list[str]:
    process, url = start_vllm(eager=False)
    process.fleet_group = True  # type: ignore[attr-defined]
    product.route("smollm2", url)
    results = []
    for streams in (1, 32):
        direct, through = compare("vLLM CPU, demo model", url, product.url, "smollm2",
                                  streams, 128, product.key, 1)
        results.append(f"vLLM {streams}: +{through.ttft(0.5) - direct.ttft(0.5):.1f} ms, "
                       f"x{through.rate / direct.rate:.3f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true", help="also measure the real vLLM CPU "
                        "server with the demo model, direct and through the gateway (starts "
                        "one, about 2 minutes)")
    parser.add_argument("--quick", action="store_true", help="one round per load")
    parser.add_argument("--loads", type=load_names, metavar="NAME,...",
                        help=f"a subset of the loads ({', '.join(LOADS)}), or any "
                        "(paced|unpaced)-STREAMS[xTOKENS], e.g. paced-128x1; default the five")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per load (default 6, "
                        "1 with --quick; 4 and 2 with --compare-with)")
    parser.add_argument("--no-router", action="store_true",
                        help="direct and the gateway only (no vllm-router)")
    parser.add_argument("--bare-relay", action="store_true", help="also a bare byte relay "
                        "in Python on uvloop before each engine (bench/bare_relay.py), the "
                        "floor of a Python relay's CPU per event; no target judged for it")
    parser.add_argument("--serial-engine", action="store_true", help="the unpaced fake "
                        "engine sends each stream's tokens back to back (whole streams one "
                        "after another), not a token a turn as a batching engine does")
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
    parser.add_argument("--profile-rate", type=int, metavar="N", help="with --profile: "
                        "samples a second (default 100 under a load, 1,000 with "
                        "--profile-idle); one paced stream keeps the gateway busy about "
                        "1%% of the time, so 100 a second gives it a few samples a second")
    parser.add_argument("--profile-native", action="store_true", help="with --profile: C "
                        "frames too (uvloop, the interpreter); pauses the gateway per sample")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the control plane under test")
    parser.add_argument("--compare-with", metavar="PATH", help="another checkout of the "
                        "project: its gateway against this one's, in interleaved rounds")
    parser.add_argument("--other-env", action="append", default=[], metavar="NAME=VALUE",
                        help="with --compare-with: a setting for the other control plane "
                        "only (`--compare-with . --other-env NAME=VALUE`: this code with "
                        "and without the setting)")
    parser.add_argument("--redis", action="store_true", help="with --compare-with: each "
                        "control plane with REDIS_URL (a database each on a private Redis): "
                        "rate limits and the route table in Redis, as for the gateway alone")
    parser.add_argument("--engine-keep-alive", type=float, metavar="SECONDS",
                        help="with --compare-with: the fake engines close a connection idle "
                        "this long (default 5, as vLLM); under a round's length, each round "
                        "of each gateway begins with its upstream connections closed")
    parser.add_argument("--other-python", metavar="PATH", help="with --compare-with: the "
                        "interpreter of the other checkout's server (an environment with "
                        "the project's requirements), e.g. another Python version")
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
    if options.profile_rate is not None and not options.profile:
        parser.error("--profile-rate goes with --profile")
    if options.profile_rate is not None and not 1 <= options.profile_rate <= 10_000:
        parser.error("--profile-rate takes 1 to 10000 samples a second")
    if options.redis and not options.compare_with:
        parser.error("--redis goes with --compare-with")
    if options.local and not options.compare_with:
        parser.error("--local goes with --compare-with")
    if options.serial_engine and (options.compare_with or options.profile):
        parser.error("--serial-engine goes with the side-by-side table (not --compare-with "
                     "or --profile)")
    if options.bare_relay and (options.compare_with or options.profile):
        parser.error("--bare-relay goes with the side-by-side table (not --compare-with "
                     "or --profile)")
    if options.other_python is not None:
        if not options.compare_with:
            parser.error("--other-python goes with --compare-with")
        if not (os.path.isfile(options.other_python)
                and os.access(options.other_python, os.X_OK)):
            parser.error(f"--other-python {options.other_python}: not an executable file")
    if options.engine_keep_alive is not None:
        if not options.compare_with or options.local:
            parser.error("--engine-keep-alive goes with --compare-with (fake engines)")
        if options.engine_keep_alive <= 0:
            parser.error("--engine-keep-alive takes a number of seconds above 0")
    extra_env = settings_given(parser, "--env", options.env)
    options.other_env = settings_given(parser, "--other-env", options.other_env)
    if options.other_env and not options.compare_with:
        parser.error("--other-env goes with --compare-with")
    if options.compare_with:
        from bench.gateway_compare import compare_checkouts

        compare_checkouts(options, extra_env)
    elif options.profile and options.profile_idle:
        from bench.gateway_profile import profile_idle

        profile_idle(options, extra_env)
    elif options.profile:
        from bench.gateway_profile import profile_gateway

        profile_gateway(options, extra_env)
    else:
        side_by_side(options, extra_env)


if __name__ == "__main__":
    main()
