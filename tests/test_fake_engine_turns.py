"""The fake engine's unpaced streams take turns a token each, as a batching engine's running
requests do; `--serial` sends each stream's tokens back to back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from fakes.engine import FakeEngine
from tests.processes import ROOT


def order_of_tokens(serial: bool, streams: int = 3, tokens: int = 5) -> list[str]:
    """Which stream each token event went to, in the order the engine sent them, for
    `streams` unpaced streams started together on one engine."""
    engine = FakeEngine("fast", 0.0, serial=serial)
    sent: list[str] = []

    async def run() -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        def sender(name: str) -> Any:
            async def send(message: dict[str, Any]) -> None:
                if message.get("more_body"):
                    sent.append(name)
            return send

        await asyncio.gather(*(engine.stream(sender(chr(ord("a") + n)), receive,
                                             {"stream": True}, tokens, chat=False)
                               for n in range(streams)))

    asyncio.run(run())
    return sent


def test_unpaced_streams_take_turns_a_token_each() -> None:
    # Like one step of a batching engine: every running stream gets its next token.
    assert order_of_tokens(serial=False) == ["a", "b", "c"] * 5


def test_serial_engine_sends_whole_streams_one_after_another() -> None:
    assert order_of_tokens(serial=True) == ["a"] * 5 + ["b"] * 5 + ["c"] * 5


def test_serial_is_refused_for_a_paced_engine() -> None:
    # Before the server starts: the exit, and the reason, come at once.
    refused = subprocess.run([sys.executable, "-m", "fakes.engine", "--port", "1",
                              "--token-interval-ms", "10", "--serial"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--serial goes with --token-interval-ms 0" in refused.stderr
