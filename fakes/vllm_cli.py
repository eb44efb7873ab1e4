"""A FAKE vLLM command line for tests and benchmarks that need many replicas quickly: takes
the arguments the local backend passes to `python -m vllm.entrypoints.openai.api_server`
(--served-model-name, --host, --port, --middleware; the rest ignored) and serves the fake engine
(fakes/engine.py) there. `stand_in_python(folder)` writes an executable the local backend's
`python` setting can name: it runs this module whatever module it is asked to run."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stand_in_python(folder: Path, token_interval_ms: float = 5.0) -> str:
    path = folder / "fake-vllm-python"
    path.write_text("#!/bin/sh\n"
                    "# A FAKE interpreter for the local backend: serves fakes/engine.py.\n"
                    f"export PYTHONPATH={ROOT}\n"
                    "shift 2  # -m vllm.entrypoints.openai.api_server\n"
                    f"exec {sys.executable} -m fakes.vllm_cli "
                    f"--token-interval-ms {token_interval_ms} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--served-model-name", default="fake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=5.0)
    parser.add_argument("--middleware", action="append", default=[])
    options, _ = parser.parse_known_args()
    sys.argv = [sys.argv[0], "--host", options.host, "--port", str(options.port),
                "--model", options.served_model_name,
                "--token-interval-ms", str(options.token_interval_ms),
                *(arg for path in options.middleware for arg in ("--middleware", path))]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from fakes.engine import main as serve

    serve()


if __name__ == "__main__":
    main()
