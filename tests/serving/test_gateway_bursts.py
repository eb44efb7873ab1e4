"""Events that reach the gateway together: a replica (a raw HTTP/1.1 server written here,
so the bytes and their cuts are exactly these) that writes a whole stream at once, its
chunks cutting events in the middle, its events carrying vLLM's usage so far
(`continuous_usage_stats`), some with a nested object. The client must get every event
whole and in order, the usage so far taken out, and the record the final usage."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Iterator

import httpx
import pytest

from serving.models import ApiKey
from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from tests.factories import make_api_key
from tests.serving.test_gateway_running_usage import record_of

pytestmark = pytest.mark.django_db(transaction=True)

TOKENS = 40


def event(index: int) -> bytes:
    """One chunk as vLLM writes it with continuous usage stats."""
    details = ',"prompt_tokens_details":{"cached_tokens":0}' if index % 3 == 0 else ""
    return (b'data: {"id":"burst","object":"text_completion","choices":[{"index":0,'
            b'"text":" t%d","finish_reason":null}],"usage":{"prompt_tokens":5,'
            b'"completion_tokens":%d,"total_tokens":%d%s}}\n\n'
            % (index, index + 1, index + 6, details.encode()))


def whole_stream(events: int) -> bytes:
    final = (b'data: {"id":"burst","object":"text_completion","choices":[],"usage":'
             b'{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}\n\n'
             b"data: [DONE]\n\n" % (events, events + 5))
    return b"".join(event(index) for index in range(events)) + final


def chunked(body: bytes, size: int) -> bytes:
    """`body` in chunks of `size` bytes: most cut an event in the middle."""
    pieces = [body[start:start + size] for start in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


class BurstReplica(socketserver.ThreadingTCPServer):
    """Answers every request with `events` events in one write."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, events: int) -> None:
        self.events = events
        super().__init__(("127.0.0.1", 0), BurstHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class BurstHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server = self.server
        assert isinstance(server, BurstReplica)
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += self.rfile.readline()
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        self.rfile.read(length)
        self.connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked(whole_stream(server.events), 97))
        self.connection.shutdown(socket.SHUT_WR)


@pytest.fixture
def burst_replica() -> Iterator[BurstReplica]:
    replica = BurstReplica(TOKENS)
    thread = threading.Thread(target=replica.serve_forever, daemon=True)
    thread.start()
    routes.publish(build_table([DeploymentRoutes(
        deployment="bursts", served_model_name="fake", policy="least-load",
        max_model_len=2048, replicas=(RouteReplica("bursts-1", replica.url, ""),),
        names=("fake",), running_usage=True)]))
    yield replica
    replica.shutdown()
    replica.server_close()


def stream_lines(gateway_url: str, request_id: str, options: dict[str, bool]) -> list[str]:
    key = make_api_key(ApiKey.Scope.INFERENCE)
    body = {"model": "fake", "prompt": "hi", "max_tokens": TOKENS, "stream": True,
            "stream_options": options}
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}",
                               "X-Request-Id": request_id}) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def test_events_that_arrive_together_reach_the_client_whole_in_order_without_usage_so_far(
        gateway_url: str, burst_replica: BurstReplica) -> None:
    lines = stream_lines(gateway_url, "burst-usage", {"include_usage": True})
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [e["choices"][0]["text"] for e in events[:-1]] == [
        f" t{index}" for index in range(TOKENS)]
    assert all("usage" not in e for e in events[:-1])  # the usage so far: taken out
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": TOKENS,
                                   "total_tokens": TOKENS + 5}
    record = record_of("burst-usage")
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (
        200, 5, TOKENS)


def test_a_client_that_asks_for_the_usage_so_far_gets_the_bytes_unchanged(
        gateway_url: str, burst_replica: BurstReplica) -> None:
    lines = stream_lines(gateway_url, "burst-running",
                         {"include_usage": True, "continuous_usage_stats": True})
    sent = [line for line in whole_stream(TOKENS).decode().split("\n") if line]
    assert lines == sent
