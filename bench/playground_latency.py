"""Playground latency: how much later than the engine's own time to first token the first
token appears in the browser.

The product (`manage.py serve`) with a deployment on an engine; headless Chromium logged
in on /playground/. For each prompt: the engine's TTFT measured by a streaming request
straight to the engine, then the same prompt sent from the playground page, its first
token timed in the page (from the Send click to the first token on screen; the page keeps
it in `data-browser-ttft-ms`). Prints the medians and their difference.

- default: the FAKE engine (fakes/engine.py), one token every 10 ms;
- --vllm: the real vLLM CPU server with the demo model (starts one, a few minutes).

    .venv/bin/python bench/playground_latency.py [--vllm] [--prompts 10]

Target: the browser's first token within 50 ms of the engine's TTFT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planes import ControlPlane, start_engine, start_vllm  # noqa: E402

PROMPT = "Name three colours of the rainbow."


CLIENT = httpx.Client(timeout=300)  # one kept-alive connection, as the gateway has


def engine_ttft(url: str, model: str) -> float:
    """Milliseconds from sending a streaming chat request to its first token, direct."""
    body = {"model": model, "max_tokens": 16, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    started = time.perf_counter()
    with CLIENT.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        lines = answer.iter_lines()
        for line in lines:
            if line.startswith("data: {") and '"content":"' in line and \
                    '"content":""' not in line:
                first = time.perf_counter() - started
                break
        else:
            raise SystemExit(f"no token from the engine: HTTP {answer.status_code}")
        for _ in lines:  # the rest, so the engine finishes the request as the page's will
            pass
    return first * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--prompts", type=int, default=10)
    options = parser.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if not chromium:
        raise SystemExit("Chromium is not installed: run scripts/ensure-chromium.sh")

    product = ControlPlane()
    engine: subprocess.Popen[bytes] | None = None
    try:
        if options.vllm:
            engine, url = start_vllm(eager=True)
            name = "smollm2"
        else:
            engine, url = start_engine(10.0, "fake")
            name = "fake"
        product.route(name, url)
        password = "playground-bench-password"
        product.create_superuser("bench", password)
        direct: list[float] = []
        browser: list[float] = []
        with sync_playwright() as playwright:
            instance = playwright.chromium.launch(
                executable_path=chromium, headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync"])
            page = instance.new_page()
            page.goto(product.url + "/login/?next=/playground/")
            page.fill("input[name=username]", "bench")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(product.url + "/playground/")
            page.wait_for_selector("#live-status.ready")
            page.select_option("#deployment-a", name)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "16")
            engine_ttft(url, name)  # warm both paths once
            for index in range(options.prompts + 1):
                direct_ms = engine_ttft(url, name)
                page.click("#clear")
                page.fill("#prompt", PROMPT)
                page.click("#send")
                page.wait_for_function(
                    "() => document.querySelector('[data-column=\"a\"] .stats')"
                    ".dataset.done", timeout=300_000)
                shown = page.locator('[data-column="a"] .stats').get_attribute(
                    "data-browser-ttft-ms")
                if index == 0 or shown is None:
                    continue  # the first round warms the page's path
                direct.append(direct_ms)
                browser.append(float(shown))
                print(f"prompt {index}: engine TTFT {direct_ms:.1f} ms, in the browser "
                      f"{float(shown):.1f} ms", flush=True)
            instance.close()
    finally:
        product.stop()
        if engine is not None:
            if options.vllm:
                os.killpg(engine.pid, signal.SIGKILL)
            else:
                engine.kill()
    engine_median, browser_median = statistics.median(direct), statistics.median(browser)
    engine_name = "vLLM CPU, demo model" if options.vllm else "fake engine, 10 ms/token"
    print(f"playground first token ({engine_name}): engine TTFT median "
          f"{engine_median:.1f} ms, browser {browser_median:.1f} ms, "
          f"difference {browser_median - engine_median:+.1f} ms (target: within 50 ms)")


if __name__ == "__main__":
    main()
