"""What the reliability tests run: `manage.py serve` with a local backend whose replicas are
FAKE engines (fakes/vllm_cli.py stands in for vLLM's command line, so a replica starts in
about a second), and clients streaming through its gateway without pause, each stream read
to its end and judged as a user's client would."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fakes.vllm_cli import stand_in_python
from tests.processes import (
    Api,
    create_key,
    end_replicas,
    free_port,
    manage,
    register_fake_model,
    server_env,
    start_server,
    stop_server,
    wait_until,
)


@dataclass
class Outcome:
    """One request as its client saw it."""

    label: str  # what the test was doing when it began
    started: float
    ended: float = 0.0
    status: int = 0
    done: bool = False  # the stream's last event was `data: [DONE]`
    error: dict[str, Any] | None = None  # an SSE error event's `error`, or the body's
    broken: str = ""  # the connection failed (a reset, a stream cut without its end)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and not self.broken

    @property
    def not_found(self) -> bool:
        """A clean refusal: the model does not exist (any more)."""
        return self.status == 404 and (self.error or {}).get("code") == "model_not_found"

    @property
    def clean_error_event(self) -> bool:
        """A stream that ended properly with an SSE error event as its last event."""
        return self.status == 200 and not self.broken and self.error is not None


@dataclass
class Traffic:
    """`clients` threads, each streaming chat completions one after another."""

    url: str
    key: str
    model: str
    clients: int = 16
    max_tokens: int = 50
    label: str = "steady"
    outcomes: list[Outcome] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Traffic:
        for index in range(self.clients):
            thread = threading.Thread(target=self.client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def stop(self) -> list[Outcome]:
        """Let every client finish the stream it reads, then stop."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a client hangs"
        return list(self.outcomes)

    def client(self, index: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as http:
            while not self.stopping.is_set():
                outcome = self.one(http, index)
                self.outcomes.append(outcome)
                if outcome.status != 200:
                    time.sleep(0.1)  # refusals come fast: keep the machine for the rest

    def one(self, http: httpx.Client, index: int) -> Outcome:
        outcome = Outcome(label=self.label, started=time.monotonic())
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                "messages": [{"role": "user", "content": f"client {index}"}]}
        try:
            with http.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {self.key}"}) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = json.loads(response.read()).get("error")
                else:
                    events = [line[6:] for line in response.iter_lines()
                              if line.startswith("data: ")]
                    outcome.done = bool(events) and events[-1] == "[DONE]"
                    last = json.loads(events[-1]) if events and not outcome.done else {}
                    outcome.error = last.get("error") if isinstance(last, dict) else None
        except (httpx.HTTPError, ValueError) as exc:
            outcome.broken = f"{exc.__class__.__name__}: {exc}"
        outcome.ended = time.monotonic()
        return outcome

    def answered(self, label: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.ok and label in (None, o.label))

    def wait_for_answers(self, count: int, label: str | None = None,
                         timeout: float = 60) -> None:
        """Wait until `count` more streams (begun under `label`, if given) ended well."""
        target = self.answered(label) + count
        wait_until(f"{count} more answered streams", lambda: self.answered(label) >= target,
                   timeout)


@dataclass
class Fleet:
    """A running `manage.py serve`, its admin key and its local backend of fake engines;
    with `gateways`, the URLs of further `manage.py serve --no-controllers` processes that
    follow its route table through Redis."""

    api: Api
    env: dict[str, str]
    gateways: list[str] = field(default_factory=list)

    def deploy(self, name: str, replicas: int) -> None:
        created = self.api.post("/api/v1/deployments/", {
            "name": name, "model": "fake", "backend": "fakes", "replicas": replicas,
            "max_replicas": 4})
        assert created.status_code == 201, created.text
        self.api.wait_for(f"{replicas} replicas routed", lambda: any(
            m["id"] == name and m["ready_replicas"] == replicas
            for m in self.api.get("/v1/models")["data"]), 60, 0.2)

    def delete(self, deployment: str) -> int:
        return httpx.delete(f"{self.api.url}/api/v1/deployments/{deployment}/", timeout=30,
                            headers={"Authorization": f"Bearer {self.api.key}"}).status_code

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        return list(self.api.get(f"/api/v1/deployments/{deployment}/")["replica_list"])

    def traffic(self, model: str, url: str = "", **options: Any) -> Traffic:
        return Traffic(url or self.api.url, self.api.key, model, **options)

    def engine_running(self, replica: dict[str, Any]) -> float:
        """vllm:num_requests_running of a replica, read from its /metrics."""
        text = httpx.get(f"{replica['endpoint']}/metrics", timeout=5).text
        line = next(line for line in text.splitlines()
                    if line.startswith("vllm:num_requests_running"))
        return float(line.rsplit(" ", 1)[1])


@contextmanager
def running_fleet(folder: Path, token_interval_ms: float, gateways_beside: int = 0,
                  **settings: str) -> Iterator[Fleet]:
    """`manage.py serve` with quick reconcile passes and health probes (`settings` adds or
    overrides: REDIS_URL for `gateways_beside` gateway processes), a fake-engine backend
    named `fakes` and the model `fake`; everything it started is ended afterwards."""
    python = stand_in_python(folder, token_interval_ms=token_interval_ms)
    env = server_env(folder / "data", **{
        "LOCAL_BACKEND_PYTHONS": python, "RECONCILE_INTERVAL_SECONDS": "0.3",
        "HEALTH_CHECK_SECONDS": "1", "STOP_GRACE_SECONDS": "2",
        "GATEWAY_LOAD_SCRAPE_SECONDS": "0.5", **settings})
    manage(env, "migrate", "--noinput", "-v0")
    register_fake_model(env, folder)
    admin = create_key(env, "tests", "--scope", "admin")
    port = free_port()
    servers = [start_server(env, port)[0]]
    try:
        gateways = []
        for _ in range(gateways_beside):
            other = free_port()
            servers.append(start_server(env, other, "--no-controllers")[0])
            gateways.append(f"http://127.0.0.1:{other}")
        api = Api(f"http://127.0.0.1:{port}", admin)
        created = api.post("/api/v1/backends/", {"name": "fakes", "kind": "local",
                                                 "config": {"python": python}})
        assert created.status_code == 201, created.text
        yield Fleet(api, env, gateways)
    finally:
        for server in reversed(servers):
            stop_server(server)
        end_replicas(env["DATA_DIR"])
