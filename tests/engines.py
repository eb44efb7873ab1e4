"""FAKE engines (fakes/engine.py) for tests, and route tables that point at them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from tests.processes import ROOT, free_port, wait_healthy


@dataclass
class FakeEngine:
    """A FAKE engine process (fakes/engine.py) on a free port."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    key: str = ""  # the bearer key it demands on /v1/* ("" : none)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[-1])


def start_fake_engine(name: str, model: str = "fake", interval_ms: float = 5,
                      host: str = "127.0.0.1", port: int = 0,
                      max_running: int = 256, key: str = "") -> FakeEngine:
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fakes.engine", "--host", host, "--port", str(port),
         "--model", model, "--token-interval-ms", str(interval_ms),
         "--max-running", str(max_running), "--api-key", key], cwd=ROOT)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, 30, process)
    except RuntimeError:
        process.kill()
        raise
    return FakeEngine(name, url, process, key)


@pytest.fixture
def fake_engines() -> Iterator[Callable[..., FakeEngine]]:
    started: list[FakeEngine] = []

    def start(name: str, **options: object) -> FakeEngine:
        engine = start_fake_engine(name, **options)  # type: ignore[arg-type]
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.process.kill()
        engine.process.wait(timeout=10)


def publish(deployment: str, engines: list[FakeEngine], *, served: str = "fake",
            policy: str = "least-load", names: tuple[str, ...] = (),
            **options: object) -> None:
    pool = DeploymentRoutes(deployment=deployment, served_model_name=served, policy=policy,
                max_model_len=2048,
                replicas=tuple(RouteReplica(e.name, e.url, e.key) for e in engines),
                names=names or (served, deployment), **options)  # type: ignore[arg-type]
    routes.publish(build_table([pool]))
