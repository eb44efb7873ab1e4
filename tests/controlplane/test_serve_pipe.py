"""Streams piped to their clients as the replica framed them (serving/upstream/pipe.py),
through `manage.py serve` in front of a FAKE engine (fakes/engine.py) registered as an
external deployment: with the official `openai` client, a client that reads nothing for
a while and then all gets every event in order (the pipe closes while the server holds
its writes back, and the rest come through the ASGI sends), and a stream's usage record
times every chunk, the piped ones too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from tests.processes import (
    ROOT,
    Api,
    create_key,
    free_port,
    manage,
    server_env,
    start_server,
    stop_server,
    wait_healthy,
    wait_until,
)

pytestmark = pytest.mark.slow

TOKENS = 3000


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, dict[str, str]]]:
    folder = tmp_path_factory.mktemp("pipe")
    engine_port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "fakes.engine", "--port",
                               str(engine_port), "--model", "fast",
                               "--token-interval-ms", "1"], cwd=ROOT)
    env = server_env(folder / "data", USAGE_FLUSH_SECONDS="0.2")
    server = None
    try:
        engine_url = f"http://127.0.0.1:{engine_port}"
        wait_healthy(engine_url, 30, engine)
        manage(env, "migrate", "--noinput", "-v0")
        admin = create_key(env, "tests", "--scope", "admin")
        port = free_port()
        server, _ = start_server(env, port)
        api = Api(f"http://127.0.0.1:{port}", admin)
        assert api.post("/api/v1/models/", {"name": "fast-model", "source": "huggingface",
                                            "hf_id": "tests/fast"}).status_code == 201
        assert api.post("/api/v1/backends/", {"name": "fast-endpoint", "kind": "external",
                                              "config": {"url": engine_url}}
                        ).status_code == 201
        assert api.post("/api/v1/deployments/", {
            "name": "fast", "model": "fast-model", "backend": "fast-endpoint",
            "engine_args": {"served_model_name": "fast"}}).status_code == 201
        api.wait_for("the deployment routed", lambda: any(
            m["id"] == "fast" and m["ready_replicas"]
            for m in api.get("/v1/models")["data"]), 60, 0.2)
        yield api, env
    finally:
        if server is not None:
            stop_server(server)
        engine.kill()
        engine.wait(timeout=10)


def test_a_client_that_stalls_then_reads_gets_every_event_in_order(
        plane: tuple[Api, dict[str, str]]) -> None:
    api, _ = plane
    port = int(api.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "fast", "prompt": "Count", "max_tokens": TOKENS,
                       "stream": True}).encode()
    with socket.socket() as connection:
        # A small receive buffer: the server's writes back up while nothing is read.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        connection.settimeout(30)
        connection.connect(("127.0.0.1", port))
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                           b"Authorization: Bearer " + api.key.encode() + b"\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        time.sleep(2)  # the stream goes on meanwhile
        answer = b""
        while not answer.endswith(b"0\r\n\r\n"):
            more = connection.recv(65536)
            assert more, answer[-200:]
            answer += more
    head, _, chunked = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
    text = dechunk(chunked)
    events = [event for event in text.split(b"\n\n") if event]
    assert events[-1] == b"data: [DONE]"
    tokens = [json.loads(event[6:])["choices"][0]["text"] for event in events[:-1]]
    assert tokens == [" tok"] * TOKENS + [""]  # every token, once each, then the finish


def dechunk(data: bytes) -> bytes:
    """A chunked body's data, its framing checked."""
    out: list[bytes] = []
    position = 0
    while True:
        line_end = data.index(b"\r\n", position)
        size = int(data[position:line_end], 16)
        if size == 0:
            assert data[line_end:] == b"\r\n\r\n"
            return b"".join(out)
        out.append(data[line_end + 2:line_end + 2 + size])
        assert data[line_end + 2 + size:line_end + 4 + size] == b"\r\n"
        position = line_end + 4 + size


def test_a_whole_streams_record_counts_every_chunk_piped(
        plane: tuple[Api, dict[str, str]]) -> None:
    api, env = plane
    client = openai.OpenAI(base_url=api.url + "/v1", api_key=api.key, max_retries=0)
    stream = client.completions.create(model="fast", prompt="Count", max_tokens=200,
                                       stream=True, extra_headers={"X-Request-Id": "whole"})
    assert sum(1 for event in stream if event.choices and event.choices[0].text) == 200

    def recorded() -> list[list[float]]:
        out = manage(env, "shell", "-c", "import json; from serving.models import UsageRecord; "
                     "print(json.dumps(list(UsageRecord.objects.filter(request_id='whole')"
                     ".values_list('completion_tokens', 'ttft_ms', 'itl_ms', 'e2e_ms'))))")
        return json.loads(out.stdout.strip().splitlines()[-1])

    [(tokens, ttft, itl, e2e)] = wait_until("the usage record", recorded, 30, 0.5)
    assert tokens == 200  # from the usage event, which is never piped
    assert itl is not None, "no inter-token latency: the piped chunks were not counted"
    # The inter-token latency spans the chunks from the first to the last, piped or not:
    # (e2e - ttft) / itl is the number of reads counted less one, about one per token.
    assert 100 <= (e2e - ttft) / itl <= 210, (ttft, itl, e2e)
