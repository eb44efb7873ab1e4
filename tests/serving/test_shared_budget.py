"""Two gateway processes, one budget: `manage.py serve` (with the controllers) and
`manage.py serve --no-controllers`, both with REDIS_URL, in front of a deployment of FAKE
engines (fakes/vllm_cli.py stands in for vLLM's command line). A key made with
`manage.py create_api_key --rpm 2` gets its third request of the minute refused, whichever
process it reaches."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fakes.vllm_cli import stand_in_python
from tests.processes import (
    Api,
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
)
from tests.serving.conftest import flush_redis_budgets

REDIS = "redis://127.0.0.1:6379/6"


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[
        str, str]]]:
    import redis

    redis.Redis.from_url(REDIS).delete("fleetplane:routes")
    base = tmp_path_factory.mktemp("budget")
    python = stand_in_python(base)
    env = server_env(base / "data", REDIS_URL=REDIS, LOCAL_BACKEND_PYTHONS=python,
                      RECONCILE_INTERVAL_SECONDS="0.3",
                      HEALTH_CHECK_SECONDS="1", GATEWAY_LOAD_SCRAPE_SECONDS="0.2",
                      STOP_GRACE_SECONDS="2")
    manage(env, "migrate", "--noinput", "-v0")
    weights = base / "weights"
    weights.mkdir()
    manage(env, "shell", "-c", "from tests.factories import make_model; "
                               f"make_model('fake', path={str(weights)!r})")
    admin = manage(env, "create_api_key", "--name", "tests", "--scope",
                   "admin").stdout.strip().splitlines()[-1]
    first_port, second_port = free_port(), free_port()
    first, _ = start_server(env, first_port)
    second, _ = start_server(env, second_port, "--no-controllers")
    api = Api(f"http://127.0.0.1:{first_port}", admin)
    try:
        assert api.post("/api/v1/backends/", {"name": "fakes", "kind": "local", "config": {
            "python": python}}).status_code == 201
        assert api.post("/api/v1/deployments/", {"name": "shared", "model": "fake",
                                                 "backend": "fakes", "replicas": 1}
                        ).status_code == 201
        for url in (api.url, f"http://127.0.0.1:{second_port}"):
            Api(url, admin).wait_for("the replica routed", lambda u=url: any(
                m["id"] == "shared" and m["ready_replicas"]
                for m in Api(u, admin).get("/v1/models")["data"]), 60, 0.2)
        yield api.url, f"http://127.0.0.1:{second_port}", env
    finally:
        stop_server(second)
        stop_server(first)
        end_replicas(env["DATA_DIR"])


def test_two_processes_share_one_budget_and_the_third_request_gets_429(
        two_gateways: tuple[str, str, dict[str, str]]) -> None:
    first, second, env = two_gateways
    flush_redis_budgets(REDIS)
    key = manage(env, "create_api_key", "--name", "tight", "--rpm", "2", "--models",
                 "shared").stdout.strip().splitlines()[-1]

    def ask(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "shared", "max_tokens": 2,
                                "messages": [{"role": "user", "content": "Hi"}]})

    answers = [ask(first), ask(second), ask(first)]
    assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].text
    assert answers[1].headers["x-ratelimit-remaining-requests"] == "0"
    assert 29 <= int(answers[2].headers["retry-after"]) <= 31
    assert ask(second).status_code == 429  # the other process knows it too


def test_the_command_refuses_bad_options(two_gateways: tuple[str, str, dict[str, str]]
                                         ) -> None:
    import subprocess

    env = two_gateways[2]
    for options, message in ((["--rpm", "0"], "at least 1"),
                             (["--priority", "urgent"], "unknown priority class"),
                             (["--team", "nobody"], "no team named"),
                             (["--expires", "yesterday"], "30d, 12h"),
                             (["--expires", "2001-01-01"], "in the future")):
        with pytest.raises(subprocess.CalledProcessError) as failed:
            manage(env, "create_api_key", "--name", "bad", *options)
        assert message in failed.value.stderr, failed.value.stderr
