"""The real vLLM server (CPU build) as a child process, for the slow tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.processes import free_port, wait_healthy


@contextlib.contextmanager
def vllm_server(model_folder: Path, served_name: str, log_path: Path,
                *extra: str) -> Iterator[str]:
    """A vLLM server for `model_folder` on a free port (eager mode, for a quicker start);
    yields its base URL and kills it on leaving."""
    port = free_port()
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(model_folder), "--served-model-name", served_name, "--port", str(port),
         "--enforce-eager", "--disable-uvicorn-access-log", *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 600, process)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        log.close()
