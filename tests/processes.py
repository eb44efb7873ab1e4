"""Running the product as a user does: `manage.py` commands and `manage.py serve` as
subprocesses on a free port, with their own data folder."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The development run's environment, as `make run` sets it (DEBUG on, SQLite in
    `data_dir`), with the product's own settings module; `extra` adds or overrides."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"DATABASE_URL", "REDIS_URL", "DEBUG", "SECRET_KEY", "ALLOWED_HOSTS",
                          "DJANGO_SETTINGS_MODULE"}}
    env.update({"DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "DEBUG": "true",
                **extra})
    return env


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=True)


def wait_healthy(url: str, timeout: float,
                 process: subprocess.Popen[Any] | None = None) -> None:
    """Wait until `url`/health answers 200; fail early if `process` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


# What each server started by start_server has printed so far (kept while its Popen is).
_OUTPUT: weakref.WeakKeyDictionary[subprocess.Popen[str], list[str]] = (
    weakref.WeakKeyDictionary())


def server_output(process: subprocess.Popen[str]) -> str:
    """What a server started by start_server has printed so far."""
    return "".join(_OUTPUT.get(process, []))


def start_server(env: dict[str, str], port: int,
                 *options: str) -> tuple[subprocess.Popen[str], str]:
    """Start `manage.py serve`; return once /healthz answers, with what it printed."""
    process = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port),
                                *options],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    _OUTPUT[process] = lines
    # Read everything it prints, so a full pipe never blocks the server.
    threading.Thread(target=lambda: lines.extend(process.stdout or []), daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                settle = time.monotonic() + 2  # the start-up lines come before the server
                while not any("Log in as" in line for line in lines) and \
                        time.monotonic() < settle:
                    time.sleep(0.05)
                return process, "".join(lines)
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("manage.py serve did not answer /healthz:\n" + "".join(lines))


def stop_server(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)


def login_from(output: str) -> tuple[str, str]:
    match = re.search(r"Log in as '(\w+)' with password '([^']+)'", output)
    assert match, output
    return match.group(1), match.group(2)


@dataclass
class Api:
    url: str
    key: str

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(self.url + path, headers=self._headers(), params=params,
                             timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return httpx.post(self.url + path, headers=self._headers(), json=body, timeout=30)

    def wait_for(self, what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
        return wait_until(what, check, timeout, interval)


def create_key(env: dict[str, str], name: str, *options: str) -> str:
    """A new API key made with `manage.py create_api_key --name NAME OPTIONS...`."""
    return manage(env, "create_api_key", "--name", name,
                  *options).stdout.strip().splitlines()[-1]


def register_fake_model(env: dict[str, str], folder: Path) -> None:
    """The registry model `fake`, its weights an empty folder under `folder` (FAKE
    engines load nothing)."""
    weights = folder / "weights"
    weights.mkdir()
    manage(env, "shell", "-c", "from tests.factories import make_model; "
                               f"make_model('fake', path={str(weights)!r})")


def wait_until(what: str, check: Any, timeout: float, interval: float = 0.2) -> Any:
    """What `check()` returns once it is truthy, asked every `interval` seconds; an
    AssertionError naming `what` and the last answer after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                         f"last seen: {last!r}")


def end_replicas(data_dir: str) -> None:
    """Replicas outlive the server on purpose (the next start adopts them): tests end the
    ones their control plane started, whole process groups (vLLM's engine core and its
    workers are children in the replica's group)."""
    import psutil

    from controlplane.backends.local import owned_processes

    groups = set()
    for process, _ in owned_processes(data_dir):
        with contextlib.suppress(OSError, psutil.Error):
            groups.add(os.getpgid(process.pid))
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
