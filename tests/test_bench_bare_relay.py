"""The bare byte relay the gateway benchmark measures as a floor (bench/bare_relay.py,
`--bare-relay`): a streamed answer comes through it byte for byte as the engine sent it,
two clients at once each on their own engine connection, and the benchmark refuses it
where it has no table to go in."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from bench.path_figures import BARE, ROUTER, Endpoint, Load, Side, print_table
from bench.planes import start_bare_relay
from bench.stream_load import Run
from tests.engines import start_fake_engine
from tests.processes import ROOT

BODY = {"model": "fake", "prompt": "x", "max_tokens": 5, "stream": True, "ignore_eos": True}


def stream(url: str) -> list[str]:
    """The SSE events of one streamed completion (the second each was made in left out)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=30) as response:
        assert response.status_code == 200
        return [re.sub(r'"created":\d+', '"created":0', line)
                for line in response.iter_lines() if line]


def test_a_stream_comes_through_the_bare_relay_as_the_engine_sent_it() -> None:
    engine = start_fake_engine("bare", interval_ms=1)
    process, url = start_bare_relay(engine.url)
    try:
        direct = stream(engine.url)
        assert stream(url) == direct and direct[-1] == "data: [DONE]"
        with httpx.Client(base_url=url, timeout=10) as first, \
                httpx.Client(base_url=url, timeout=10) as second:  # two connections
            assert first.get("/health").status_code == second.get("/health").status_code \
                == 200
            assert first.get("/v1/models").json()["data"][0]["id"] == "fake"
    finally:
        for started in (process, engine.process):
            started.kill()
            started.wait(timeout=10)


def test_no_target_is_judged_for_the_bare_relay(capsys: pytest.CaptureFixture[str]) -> None:
    def side(ttft: float, cpu: float) -> Side:
        return Side([Run([ttft] * 4, 1000, 1.0, 0)], cpu)

    load = Load("paced-1", "paced 10 ms/token", "fake", 1, 1)
    endpoints = [Endpoint("direct", {}, None, {}), Endpoint("gateway", {}, None, {"fake": 1}),
                 Endpoint(BARE, {}, None, {"fake": 2}), Endpoint(ROUTER, {}, None, {"fake": 3})]
    # The bare relay slower and dearer than the router: still no target line for it.
    print_table([(load, endpoints, [side(10, 0), side(11, 0.1), side(30, 0.5),
                                    side(11, 0.2)])], 1)
    out = capsys.readouterr().out
    assert f"| paced-1 | {BARE} |" in out
    assert "target (gateway)" in out and f"target ({BARE})" not in out


@pytest.mark.parametrize("arguments", [["--compare-with", "."], ["--profile", "/tmp/p.txt"]])
def test_the_benchmark_refuses_the_bare_relay_outside_its_table(arguments: list[str]) -> None:
    done = subprocess.run([sys.executable, "bench/gateway_overhead.py", "--bare-relay",
                           *arguments], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--bare-relay goes with the side-by-side table" in done.stderr
