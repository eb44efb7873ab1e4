"""A bare byte relay on uvloop, for bench/gateway_overhead.py --bare-relay: each client
connection gets its own connection to one engine, and every byte read on either side is
written to the other at once. No HTTP parsing, no key, no limit, no routing: the least
any relay written in Python on the gateway's event loop can do per event, measured beside
the gateway and the Rust router as a floor (the gateway's CPU per event above it is the
gateway's own work). A benchmark's reference path, never a way to serve.

    .venv/bin/python -m bench.bare_relay --port PORT --upstream HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop


class Upstream(asyncio.Protocol):
    """The engine's side of one client connection."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.client.transport is not None:
            self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client.transport is not None:
            self.client.transport.close()


class Client(asyncio.Protocol):
    """One client connection, relayed to a connection of its own to the engine."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None
        self.early: list[bytes] = []  # what the client sent before the engine's socket opened
        self.connecting: asyncio.Task[None] | None = None  # held: a task nobody holds may go

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connecting = asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(
                lambda: Upstream(self), self.host, self.port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.upstream = upstream
        assert upstream.transport is not None
        for data in self.early:
            upstream.transport.write(data)
        self.early.clear()
        if self.transport is None or self.transport.is_closing():
            upstream.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def serve(port: int, host: str, upstream_port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: Client(host, upstream_port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    options = parser.parse_args()
    host, _, port = options.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--upstream {options.upstream!r}: expected HOST:PORT")
    uvloop.run(serve(options.port, host, int(port)))


if __name__ == "__main__":
    main()
