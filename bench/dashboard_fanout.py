"""Dashboard fan-out: what 200 open dashboards cost the server.

The product (`manage.py serve`, controllers and collector included, SCRAPE_INTERVAL=1)
with one deployment on a FAKE engine (fakes/engine.py) under light traffic, and
200 WebSocket clients logged in and subscribed to that deployment's dashboard, each
receiving one update per second. The server process's CPU time is measured over windows
of the same length with no dashboard open and with all 200 open, alternating round by
round (without, with, without, with); the difference is the fan-out's cost.

    .venv/bin/python bench/dashboard_fanout.py [--sockets 200] [--seconds 30] [--rounds 2]

Prints the cost in percent of one core; the target is under 20%.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planes import ControlPlane, start_engine  # noqa: E402


def session_cookie(url: str, username: str, password: str) -> str:
    with httpx.Client(base_url=url, timeout=30) as client:
        page = client.get("/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, "no CSRF token on the login page"
        answer = client.post("/login/", data={"username": username, "password": password,
                                              "csrfmiddlewaretoken": token.group(1)},
                             headers={"Referer": url + "/login/"})
        if answer.status_code != 302:
            raise SystemExit(f"login failed: HTTP {answer.status_code}")
        return "; ".join(f"{name}={value}" for name, value in client.cookies.items())


async def dashboards(url: str, cookie: str, deployment: str, sockets: int, seconds: float,
                     process: psutil.Process) -> tuple[float, int, int]:
    from websockets.asyncio.client import connect

    received = [0] * sockets
    ws_url = url.replace("http://", "ws://") + f"/ws/dashboard/{deployment}/"
    stop = asyncio.Event()

    async def one(index: int) -> None:
        async with connect(ws_url, additional_headers={"Cookie": cookie, "Origin": url},
                           max_size=None) as socket:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(socket.recv(), timeout=0.5)
                except TimeoutError:
                    continue
                received[index] += 1

    tasks = [asyncio.get_running_loop().create_task(one(i)) for i in range(sockets)]
    await asyncio.sleep(5)  # everyone connected, the history sent
    failed = [t for t in tasks if t.done() and t.exception()]
    if failed:
        raise SystemExit(f"{len(failed)} sockets failed: {failed[0].exception()!r}")
    before = sum(received)
    cpu = cpu_seconds(process)
    await asyncio.sleep(seconds)
    used = cpu_seconds(process) - cpu
    count = sum(received) - before
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return used, count, sum(1 for n in received if n)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30, help="per window")
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    product = ControlPlane(SCRAPE_INTERVAL="1")
    engines: list[subprocess.Popen[bytes]] = []
    try:
        engine, engine_url = start_engine(5.0, "fake")
        engines.append(engine)
        product.route("fake", engine_url)
        password = "fanout-bench-password"
        product.create_superuser("fanout", password)
        cookie = session_cookie(product.url, "fanout", password)
        process = psutil.Process(product.process.pid)
        stop = False

        def traffic() -> None:
            while not stop:
                httpx.post(f"{product.url}/v1/completions", timeout=30,
                           headers={"Authorization": f"Bearer {product.key}"},
                           json={"model": "fake", "prompt": "hi", "max_tokens": 16})
                time.sleep(0.05)

        import threading

        load = threading.Thread(target=traffic, daemon=True)
        load.start()
        time.sleep(3)
        idle = used = 0.0
        messages = live = 0
        # Interleaved round by round (without, with, without, with ...), so both windows
        # see the same machine.
        for _ in range(options.rounds):
            idle_start = cpu_seconds(process)
            time.sleep(options.seconds)  # the window measured without dashboards
            idle += cpu_seconds(process) - idle_start
            cpu, count, receiving = asyncio.run(dashboards(
                product.url, cookie, "fake", options.sockets, options.seconds, process))
            used, messages, live = used + cpu, messages + count, min(live or receiving,
                                                                     receiving)
        stop = True
        load.join(timeout=30)
    finally:
        product.stop()
        for engine in engines:
            engine.kill()
    seconds = options.seconds * options.rounds
    print(f"server CPU without dashboards: {idle / seconds * 100:.1f}% of one core; with "
          f"{options.sockets} dashboards: {used / seconds * 100:.1f}%; {messages} messages "
          f"({messages / seconds / max(live, 1):.2f} per socket per second, {live} sockets "
          f"receiving)")
    print(f"dashboard fan-out: {options.sockets} sockets cost "
          f"{(used - idle) / seconds * 100:.1f}% of one core (target: under 20%)")


if __name__ == "__main__":
    main()
