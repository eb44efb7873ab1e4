"""The processes the gateway benchmarks measure and drive: the fake engines
(fakes/engine.py) and the real vLLM CPU server, the control plane with engines registered
as external deployments (the embedded default, `make run`'s environment), the gateway alone
in its process beside `run_controllers`, `serve --workers N`, and another checkout's
server. Used by bench/gateway_overhead.py and the benchmarks built on it."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.processes import (  # noqa: E402
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)

ENGINE_KEEP_ALIVE = 5.0  # seconds a fake engine keeps an idle connection open, as vLLM
# The load key's limits: far above any load here (64 unpaced streams relay about 11
# million tokens a minute), never refusing, always checked.
KEY_RPM, KEY_TPM = 100_000_000, 2_000_000_000


SETTING_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def settings_given(parser: argparse.ArgumentParser, option: str, items: list[str]
                   ) -> dict[str, str]:
    """NAME=VALUE settings as a dict; a malformed or repeated one is the parser's error."""
    settings: dict[str, str] = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not SETTING_NAME.fullmatch(name):
            parser.error(f"{option} {item!r}: takes NAME=VALUE, NAME in capitals "
                         "(e.g. HEALTH_CHECK_SECONDS=30)")
        if name in settings:
            parser.error(f"{option} {name} is given twice")
        settings[name] = value
    return settings


def start_engine(interval_ms: float, model: str, keep_alive: float = ENGINE_KEEP_ALIVE,
                 serial: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """A fake engine with stamped first events; `serial`: unpaced, whole streams one
    after another instead of a token a turn (fakes/engine.py --serial)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port", str(port),
                                "--model", model, "--token-interval-ms", str(interval_ms),
                                "--keep-alive", str(keep_alive), "--stamp",
                                *(["--serial"] if serial else [])],
                               cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30)
    return process, url


def start_bare_relay(engine_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """bench/bare_relay.py before one engine, once /health answers through it."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.bare_relay", "--port", str(port),
                                "--upstream", engine_url.removeprefix("http://")], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30, process)
    except BaseException:
        process.kill()
        raise
    return process, url


class ControlPlane:
    """The control plane, with engines registered as external deployments."""

    root = ROOT  # whose code runs: this checkout's
    python = sys.executable  # the interpreter that runs it: this benchmark's
    serve_options: tuple[str, ...] = ()  # `manage.py serve`'s, e.g. --no-controllers

    def __init__(self, **extra_env: str) -> None:
        data = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        root = self.root
        self.env = server_env(data / "data", LOG_LEVEL="WARNING", **extra_env)
        self.manage("migrate", "--noinput", "-v0")
        self.admin = self.manage("create_api_key", "--name", "bench", "--scope",
                                 "admin").stdout.strip().splitlines()[-1]
        # Rate limits no load here reaches, so the limiter is in the measured path (with
        # REDIS_URL, a Redis round trip per request) as on a shared fleet.
        self.key = self.manage("create_api_key", "--name", "load", "--scope", "inference",
                               "--rpm", str(KEY_RPM), "--tpm", str(KEY_TPM)
                               ).stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if not self.elsewhere:
            self.process, _ = start_server(self.env, self.port, *self.serve_options)
        else:
            self.process = start_server_in(root, self.env, self.port, self.python)

    @property
    def database(self) -> Path:
        """Its SQLite file (absent where DATABASE_URL names another database)."""
        return Path(self.env["DATA_DIR"]) / "db.sqlite3"

    @property
    def elsewhere(self) -> bool:
        """Another checkout's code or another interpreter than this benchmark's."""
        return self.root != ROOT or self.python != sys.executable

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A manage.py command of this product's checkout."""
        if not self.elsewhere:
            return manage(self.env, *args)
        return subprocess.run([self.python, "manage.py", *args], cwd=self.root,
                              env=self.env, capture_output=True, text=True, timeout=300,
                              check=True)

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
        self.wait_routable(name)

    def run_locally(self, name: str, python: str) -> None:
        """`name` served by one replica this control plane runs (a local backend whose
        interpreter is `python`, a stand-in serving the fake engine)."""
        weights = Path(tempfile.mkdtemp(prefix=f"gateway-bench-{name}-weights-"))
        self.manage("shell", "-c", "from tests.factories import make_model; "
                                   f"make_model({name + '-model'!r}, path={str(weights)!r})")
        self.api("/api/v1/backends/", {"name": f"{name}-fakes", "kind": "local",
                                       "config": {"python": python}})
        self.api("/api/v1/deployments/", {"name": name, "model": f"{name}-model",
                                          "backend": f"{name}-fakes", "replicas": 1,
                                          "engine_args": {"served_model_name": name}})
        self.wait_routable(name)

    def wait_routable(self, name: str) -> None:
        """Until the gateway lists `name` with a ready replica."""
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
        """Stop the server, and the collector's parsing worker and its resource tracker,
        which outlive a stopped `serve` (they are left running, parented to init)."""
        import psutil

        try:
            helpers = [child for child in psutil.Process(self.process.pid).children(True)
                       if "multiprocessing" in " ".join(child.cmdline())]
        except psutil.Error:
            helpers = []
        stop_server(self.process)
        for helper in helpers:
            with contextlib.suppress(psutil.Error):
                helper.kill()
        end_replicas(self.env["DATA_DIR"])  # replicas it ran (they outlive it on purpose)


class GatewayOnly(ControlPlane):
    """The gateway in a process of its own (`manage.py serve --no-controllers`), the
    controllers and collector in another (`manage.py run_controllers`), sharing the
    database and a Redis server (the route table reaches the gateway through it). Its
    CPU figures are the gateway process's alone."""

    serve_options = ("--no-controllers",)

    def __init__(self, redis_url: str, **extra_env: str) -> None:
        super().__init__(REDIS_URL=redis_url, **extra_env)
        self.controllers = subprocess.Popen(
            [sys.executable, "manage.py", "run_controllers"], cwd=ROOT, env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """The gateway, then the controllers (their replicas: none, all external)."""
        self.controllers.terminate()
        try:
            self.controllers.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.controllers.kill()
        super().stop()


class GatewayWorkers(ControlPlane):
    """`manage.py serve --workers N`: N gateway worker processes on one port, the
    controllers once in their parent, sharing a Redis server (as --workers requires). Its
    CPU figures are the whole process tree's: parent, workers and the collector's helper."""

    def __init__(self, workers: int, redis_url: str, **extra_env: str) -> None:
        self.serve_options = ("--workers", str(workers))
        super().__init__(REDIS_URL=redis_url, **extra_env)

    def route(self, name: str, engine_url: str) -> None:
        super().route(name, engine_url)
        wait_routed_by_every_worker(self, name)


def wait_routed_by_every_worker(plane: ControlPlane, name: str) -> None:
    """Until 20 fresh connections in a row (spread over the workers by the kernel) find
    `name` routable: each worker takes the route table from Redis on its own."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(any(m["id"] == name and m["ready_replicas"] for m in httpx.get(
                f"{plane.url}/v1/models", timeout=5, headers={
                    "Authorization": f"Bearer {plane.key}"}).json()["data"])
               for _ in range(20)):
            return
        time.sleep(0.2)
    raise SystemExit(f"deployment {name} not routed by every worker")


def start_server_in(root: Path, env: dict[str, str], port: int,
                    python: str = sys.executable) -> subprocess.Popen[str]:
    """`manage.py serve` of another checkout (or under another interpreter), once it
    answers /healthz."""
    process = subprocess.Popen([python, "manage.py", "serve", "--port", str(port)],
                               cwd=root, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"manage.py serve in {root} did not answer /healthz")


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
