"""At shutdown: `manage.py serve` stopped with SIGTERM writes the usage records its gateway
still held buffered, and leaves none of its helper processes behind (the replicas it runs
are kept, for the next start to adopt), in front of a FAKE engine (fakes/vllm_cli.py stands
in for vLLM's command line)."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest

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
)

pytestmark = pytest.mark.slow


def test_a_stopped_server_writes_the_usage_it_still_held(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path)
    # Records are written once an hour, or when the server stops.
    env = server_env(tmp_path / "data", LOCAL_BACKEND_PYTHONS=python,
                      USAGE_FLUSH_SECONDS="3600", RECONCILE_INTERVAL_SECONDS="0.3",
                      HEALTH_CHECK_SECONDS="1", STOP_GRACE_SECONDS="2")
    manage(env, "migrate", "--noinput", "-v0")
    register_fake_model(env, tmp_path)
    admin = create_key(env, "tests", "--scope", "admin")
    port = free_port()
    server, _ = start_server(env, port)
    api = Api(f"http://127.0.0.1:{port}", admin)
    try:
        assert api.post("/api/v1/backends/", {"name": "fakes", "kind": "local", "config": {
            "python": python}}).status_code == 201
        assert api.post("/api/v1/deployments/", {"name": "chat", "model": "fake",
                                                 "backend": "fakes", "replicas": 1}
                        ).status_code == 201
        api.wait_for("the replica routed", lambda: any(
            m["id"] == "chat" and m["ready_replicas"]
            for m in api.get("/v1/models")["data"]), 60, 0.2)
        answer = httpx.post(f"{api.url}/v1/chat/completions", timeout=30,
                            headers={"Authorization": f"Bearer {admin}",
                                     "X-Request-Id": "before-the-stop"},
                            json={"model": "chat", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        # Helper processes the server started, if any (a collector of a large fleet
        # parses in one, and Python's resource tracker comes with it; a small fleet's
        # parses in its pass: tests/controlplane/metrics/test_scraping.py).
        helpers = [child for child in psutil.Process(server.pid).children(recursive=True)
                   if "multiprocessing" in " ".join(child.cmdline())]
    finally:
        stop_server(server)
        end_replicas(env["DATA_DIR"])
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert alive == [], [p.cmdline() for p in alive]
    stored = manage(env, "shell", "-c", "from serving.models import UsageRecord; print("
                    "list(UsageRecord.objects.values_list('request_id', 'completion_tokens')))")
    assert stored.stdout.strip().splitlines()[-1] == "[('before-the-stop', 2)]"
