"""Soak: hours of mixed traffic must leave no leak in the server process.

The product (`manage.py serve`, controllers and collector included) with one deployment
on a FAKE engine (fakes/engine.py, 5 ms a token) registered as an external endpoint, and
a paced mix of traffic for `--minutes` (default 20), every kind in turn from each of
`--workers` clients:

- streamed and whole completions and chat completions through `/v1/`;
- streams the client abandons after its third event (the connection is closed);
- bad requests: a body that is not JSON, an unknown model, a wrong key;
- a playground WebSocket session (`/ws/playground/`: one generation to its `done`);
- dashboard page loads (`/dashboard/`, `/dashboard/<deployment>/`) and the live
  dashboard socket (`/ws/dashboard/<deployment>/`: its history and one update).

Every `--sample-seconds` (default 10) the clients finish what they are doing and wait
(a quiet point, so in-flight work does not read as growth), and the server process's
resident memory, open file descriptors and threads (psutil) and the tasks alive on its
event loop (the gauge `fleetplane_process_asyncio_tasks` of its /metrics) are sampled.
After a warm-up (`--warm-up-minutes`; by default the first fifth of the run, at least one
minute) a straight line is fitted to each, and its slope printed as growth per hour. The
collector keeps 15 minutes of samples per series (controlplane/metrics/store.py), so its
memory fills for the first 15 minutes: a run that measures a leak, not that filling, has a
warm-up of at least 16 minutes.

Bounds (the verdict, last line): resident memory grows less than 5 MiB an hour; file
descriptors, threads and tasks do not grow beyond noise (the fitted rise over the
measured window is under one, or under twice the standard deviation of the samples about
the line); no answer with a 5xx status and no failed exchange (a stream or a socket that
ended in an error where none was expected).

    .venv/bin/python bench/soak.py [--minutes 20] [--warm-up-minutes M] [--workers 6]
                                   [--sample-seconds 10] [--env NAME=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.dashboard_fanout import session_cookie  # noqa: E402
from bench.planes import ControlPlane, settings_given, start_engine  # noqa: E402

MODEL = "fake"
MIB = 1024 * 1024
RSS_BOUND_MIB_PER_HOUR = 5.0


@dataclass
class Tally:
    """What the clients saw."""

    statuses: Counter[int] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def status(self, action: str, status: int, expected: int) -> None:
        self.statuses[status] += 1
        self.actions[action] += 1
        if status != expected:
            self.fail(f"{action}: HTTP {status}, expected {expected}")

    def fail(self, what: str) -> None:
        if len(self.failures) < 1000:
            self.failures.append(what)

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)


@dataclass
class Sample:
    at: float  # seconds since the traffic started
    rss: int
    fds: int
    threads: int
    tasks: int


class Traffic:
    """The paced mix of requests and sockets, with quiet points for the sampler."""

    def __init__(self, url: str, key: str, cookie: str, tally: Tally) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://")
        self.key = key
        self.cookie = cookie
        self.tally = tally
        self.go = asyncio.Event()
        self.go.set()
        self.busy = 0
        self.stopping = False
        self.actions: list[Callable[[aiohttp.ClientSession], Awaitable[None]]] = [
            self.stream, self.whole, self.chat_stream, self.abort, self.bad_json,
            self.unknown_model, self.bad_key, self.playground, self.pages, self.dashboard,
        ]

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    async def worker(self, index: int) -> None:
        # A new connection for every request: a quiet point then holds no client socket,
        # and the churn itself is part of the soak.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            turn = index
            while not self.stopping:
                await self.go.wait()
                if self.stopping:
                    return
                self.busy += 1
                action = self.actions[turn % len(self.actions)]
                try:
                    await asyncio.wait_for(action(session), timeout=60)
                except Exception as error:  # a failed exchange is a finding, not an end
                    self.tally.fail(f"{action.__name__}: {error!r}")
                finally:
                    self.busy -= 1
                turn += 1
                await asyncio.sleep(0.1)  # pacing: about ten actions a second per client

    async def quiet(self) -> None:
        """Let every client finish its action and wait (bounded)."""
        self.go.clear()
        deadline = time.monotonic() + 90
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        self.go.set()

    async def completion(self, session: aiohttp.ClientSession, action: str,
                         body: dict[str, object], path: str = "/v1/completions") -> None:
        async with session.post(self.url + path, json=body, headers=self.auth()) as answer:
            text = await answer.text()
            self.tally.status(action, answer.status, 200)
            if body.get("stream") and (answer.status != 200 or "data: [DONE]" not in text
                                       or '"error"' in text):
                self.tally.fail(f"{action}: the stream did not end cleanly: {text[-300:]!r}")

    async def stream(self, session: aiohttp.ClientSession) -> None:
        await self.completion(session, "stream", {"model": MODEL, "prompt": "Count:",
                                                  "max_tokens": 32, "stream": True})

    async def whole(self, session: aiohttp.ClientSession) -> None:
        await self.completion(session, "whole", {"model": MODEL, "prompt": "Count:",
                                                 "max_tokens": 16})

    async def chat_stream(self, session: aiohttp.ClientSession) -> None:
        await self.completion(session, "chat stream", {
            "model": MODEL, "max_tokens": 24, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}, "/v1/chat/completions")

    async def abort(self, session: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "stream": True}
        async with session.post(self.url + "/v1/completions", json=body,
                                headers=self.auth()) as answer:
            self.tally.status("abort", answer.status, 200)
            events = 0
            async for line in answer.content:
                if line.startswith(b"data: {"):
                    events += 1
                if events == 3:
                    answer.close()  # the client goes away mid-stream
                    return
            self.tally.fail("abort: the stream ended before its third event")

    async def refused(self, session: aiohttp.ClientSession, action: str, data: bytes,
                      expected: int, key: str | None = None) -> None:
        async with session.post(self.url + "/v1/completions", data=data,
                                headers={**self.auth(key),
                                         "Content-Type": "application/json"}) as answer:
            await answer.read()
            status = answer.status
            # Past GATEWAY_AUTH_FAILURES_PER_MINUTE wrong keys an address gets 429.
            self.tally.status(action, status, 429 if status == 429 and key else expected)

    async def bad_json(self, session: aiohttp.ClientSession) -> None:
        await self.refused(session, "bad JSON", b'{"model": "fake", "prompt": ', 400)

    async def unknown_model(self, session: aiohttp.ClientSession) -> None:
        body = json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()
        await self.refused(session, "unknown model", body, 404)

    async def bad_key(self, session: aiohttp.ClientSession) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
        await self.refused(session, "bad key", body, 401, key="fp-not-a-key-0123456789")

    def socket_headers(self) -> dict[str, str]:
        return {"Cookie": self.cookie, "Origin": self.url}

    async def playground(self, session: aiohttp.ClientSession) -> None:
        from websockets.asyncio.client import connect

        self.tally.actions["playground"] += 1
        async with connect(self.ws_url + "/ws/playground/",
                           additional_headers=self.socket_headers()) as socket:
            await socket.send(json.dumps({
                "type": "generate", "id": "a", "deployment": MODEL, "max_tokens": 16,
                "temperature": 0, "messages": [{"role": "user", "content": "Hello"}]}))
            while True:
                message = json.loads(await socket.recv())
                if message["type"] == "done":
                    return
                if message["type"] == "error":
                    self.tally.fail(f"playground: {message}")
                    return

    async def pages(self, session: aiohttp.ClientSession) -> None:
        for path in ("/dashboard/", f"/dashboard/{MODEL}/"):
            async with session.get(self.url + path,
                                   headers={"Cookie": self.cookie}) as answer:
                await answer.read()
                self.tally.status("dashboard page", answer.status, 200)

    async def dashboard(self, session: aiohttp.ClientSession) -> None:
        from websockets.asyncio.client import connect

        self.tally.actions["dashboard socket"] += 1
        async with connect(self.ws_url + f"/ws/dashboard/{MODEL}/", max_size=None,
                           additional_headers=self.socket_headers()) as socket:
            kinds = [json.loads(await socket.recv())["type"] for _ in range(2)]
            if kinds[0] != "history":
                self.tally.fail(f"dashboard socket: first message {kinds[0]!r}")


async def scrape_tasks(url: str) -> int:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, \
            session.get(url + "/metrics") as answer:
        text = await answer.text()
    for line in text.splitlines():
        if line.startswith("fleetplane_process_asyncio_tasks "):
            return int(float(line.split()[1]))
    raise SystemExit("/metrics has no fleetplane_process_asyncio_tasks")


async def soak(product: ControlPlane, cookie: str, options: argparse.Namespace,
               tally: Tally) -> list[Sample]:
    process = psutil.Process(product.process.pid)
    traffic = Traffic(product.url, product.key, cookie, tally)
    workers = [asyncio.create_task(traffic.worker(i)) for i in range(options.workers)]
    samples: list[Sample] = []
    started = time.monotonic()
    end = started + options.minutes * 60
    while time.monotonic() < end:
        await asyncio.sleep(min(options.sample_seconds, max(0.0, end - time.monotonic())))
        await traffic.quiet()
        tasks = await scrape_tasks(product.url)
        memory = process.memory_info()
        sample = Sample(time.monotonic() - started, memory.rss, process.num_fds(),
                        process.num_threads(), tasks)
        samples.append(sample)
        traffic.resume()
        print(f"{sample.at:7.0f} s  RSS {sample.rss / MIB:7.1f} MiB  fds {sample.fds:4d}  "
              f"threads {sample.threads:3d}  tasks {sample.tasks:4d}  "
              f"actions {sum(tally.actions.values()):7d}  5xx {tally.server_errors}  "
              f"failed {len(tally.failures)}", flush=True)
    traffic.stopping = True
    traffic.resume()
    await asyncio.gather(*workers)
    return samples


@dataclass
class Fit:
    per_hour: float  # the slope, per hour
    rise: float  # the fitted rise over the measured window
    noise: float  # standard deviation of the samples about the line


def fit(times: list[float], values: list[float]) -> Fit:
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / spread
    residuals = [v - (mean_v + slope * (t - mean_t)) for t, v in zip(times, values, strict=True)]
    noise = statistics.pstdev(residuals)
    return Fit(slope * 3600, slope * (times[-1] - times[0]), noise)


def verdict(samples: list[Sample], warm_up: float, tally: Tally, minutes: float) -> bool:
    measured = [s for s in samples if s.at >= warm_up]
    if len(measured) < 3:
        raise SystemExit("too few samples after the warm-up: run longer")
    times = [s.at for s in measured]
    ok = True
    report: list[str] = []
    rss = fit(times, [s.rss / MIB for s in measured])
    rss_ok = rss.per_hour < RSS_BOUND_MIB_PER_HOUR
    ok &= rss_ok
    print(f"RSS: {measured[0].rss / MIB:.1f} -> {measured[-1].rss / MIB:.1f} MiB, growth "
          f"{rss.per_hour:+.2f} MiB/h (noise {rss.noise:.2f} MiB; bound < "
          f"{RSS_BOUND_MIB_PER_HOUR:.0f} MiB/h: {'met' if rss_ok else 'MISSED'})")
    report.append(f"RSS {rss.per_hour:+.2f} MiB/h")
    for name in ("fds", "threads", "tasks"):
        values = [float(getattr(s, name)) for s in measured]
        line = fit(times, values)
        within = line.rise < max(1.0, 2 * line.noise)
        ok &= within
        print(f"{name}: {values[0]:.0f} -> {values[-1]:.0f} (min {min(values):.0f}, max "
              f"{max(values):.0f}), growth {line.per_hour:+.2f}/h, fitted rise "
              f"{line.rise:+.2f} over the window (noise {line.noise:.2f}; bound: within "
              f"noise: {'met' if within else 'MISSED'})")
        report.append(f"{name} {line.per_hour:+.2f}/h")
    print("actions: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.actions.items())))
    print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.statuses.items())))
    for failure in tally.failures[:10]:
        print(f"failed: {failure}")
    ok &= tally.server_errors == 0 and not tally.failures
    window = (times[-1] - times[0]) / 60
    print(f"soak {minutes:g} min ({window:.1f} min measured after a {warm_up / 60:.1f} min "
          f"warm-up, {len(measured)} samples): " + ", ".join(report) +
          f"; 5xx {tally.server_errors}; failed exchanges {len(tally.failures)} | bounds: "
          f"RSS < {RSS_BOUND_MIB_PER_HOUR:.0f} MiB/h, fds/threads/tasks within noise, zero "
          f"5xx and failures: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--warm-up-minutes", type=float, default=None,
                        help="samples before this are not fitted (default: a fifth of the "
                             "run, at least one minute)")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--sample-seconds", type=float, default=10)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the server under test")
    options = parser.parse_args()
    extra_env = settings_given(parser, "--env", options.env)
    warm_up = (options.warm_up_minutes * 60 if options.warm_up_minutes is not None
               else max(60.0, options.minutes * 60 / 5))
    if warm_up >= options.minutes * 60:
        raise SystemExit("the warm-up must be shorter than the run")
    product = ControlPlane(**{"SCRAPE_INTERVAL": "2", **extra_env})
    engines: list[subprocess.Popen[bytes]] = []
    tally = Tally()
    try:
        engine, engine_url = start_engine(5.0, MODEL)
        engines.append(engine)
        product.route(MODEL, engine_url)
        password = "soak-bench-password"
        product.create_superuser("soak", password)
        cookie = session_cookie(product.url, "soak", password)
        samples = asyncio.run(soak(product, cookie, options, tally))
    finally:
        product.stop()
        for process in engines:
            process.kill()
    if not verdict(samples, warm_up, tally, options.minutes):
        sys.exit(1)


if __name__ == "__main__":
    main()
