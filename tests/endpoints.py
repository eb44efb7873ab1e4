"""A stand-in for an OpenAI-compatible endpoint that something else runs (for the external
backend): it answers /v1/models, and can be switched to failing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandInEndpoint:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.healthy = True
        self.requests = 0

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"


def write_body(handler: BaseHTTPRequestHandler, body: bytes, content_type: str) -> None:
    """The rest of an answer whose status line is sent: its headers and body."""
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def stand_in_endpoint() -> Iterator[StandInEndpoint]:
    state: dict[str, StandInEndpoint] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            endpoint = state["endpoint"]
            endpoint.requests += 1
            if self.path == "/v1/models" and endpoint.healthy:
                body = json.dumps({"object": "list", "data": [{"id": "remote"}]}).encode()
                self.send_response(200)
            else:
                body = b'{"error": "unavailable"}'
                self.send_response(503)
            write_body(self, body, "application/json")

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["endpoint"] = StandInEndpoint(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["endpoint"]
    finally:
        server.shutdown()
        server.server_close()
