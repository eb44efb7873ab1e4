"""A fuzz of the WebSocket consumers (hypothesis): random frames (text, binary, huge,
malformed JSON, JSON of the wrong types, lone surrogates) to the playground and the
dashboards. No exception escapes a consumer; every frame is answered with messages that
have a `type` (an error naming what was wrong) or the socket closes with a code; and the
socket (or a new one) still answers a ping afterwards.

The consumers run in this process through Channels' ASGI interface (the test
communicator of tests/controlplane/test_consumers.py), the playground with a FAKE engine
(fakes/engine.py) behind the gateway's route table. Derandomized and bounded; more with
FUZZ_EXAMPLES=2000 (and FUZZ_RANDOM=1 for new cases).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.controlplane.test_consumers import WebsocketCommunicator, application, make_user
from tests.engines import FakeEngine, publish, start_fake_engine
from tests.private_loop import private_loop

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=not os.environ.get("FUZZ_RANDOM"),
                deadline=None, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
FRAME_LIMIT = 4096

awkward_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "\x00", "\u202eevil\u202c", "\ud800", "x\udfffy", "demo", "main",
                     "\U0001f600", "  ", "a" * 65]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300),
                    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -0.0, 0.5]),
                    st.floats(-3, 3), awkward_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(awkward_text, inner, max_size=3)),
    max_leaves=8)
turns = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | json_values,
     "content": awkward_text | json_values}), max_size=3)
FIELDS = {
    "type": st.sampled_from(["generate", "stop", "ping", "dance", ""]) | json_values,
    "id": st.sampled_from(["main", "a", "b"]) | json_values,
    "deployment": st.sampled_from(["demo", "absent"]) | json_values,
    "messages": turns | json_values,
    "system": awkward_text | json_values,
    "max_tokens": st.integers(1, 4) | json_values,
    "temperature": json_values, "top_p": json_values, "seed": json_values,
}
GENERATE = {"type": "generate", "deployment": "demo", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
# Mostly a generation that would run, with a few fields changed, added or taken out: so
# the fuzz reaches past the first check into the engine and back.
changes = st.dictionaries(
    st.sampled_from(list(FIELDS)) | awkward_text,
    st.sampled_from(list(FIELDS)).flatmap(lambda name: FIELDS[name]), max_size=3)
messages = st.tuples(changes, st.sets(st.sampled_from(list(GENERATE)), max_size=1),
                     st.sampled_from([GENERATE, GENERATE, {"type": "stop"}, {}])).map(
    lambda found: {name: value for name, value in {**found[2], **found[0]}.items()
                   if name not in found[1]})


def as_text(message: Any) -> str:
    # Lone surrogates stay in the str (an ASGI server could not deliver them, a test can).
    return json.dumps(message, ensure_ascii=False)


frames = st.one_of(
    messages.map(lambda message: ("text", as_text(message))),
    messages.map(lambda message: ("text", as_text(message))),
    json_values.map(lambda value: ("text", as_text(value))),
    awkward_text.map(lambda text: ("text", text)),
    st.sampled_from(["{", '{"type": "generate"', "[]", "null", '"ping"', "{'type': 'ping'}",
                     '{"type": "ping"}}', "\ud800", "\x00" * 8, "1e309", "NaN"]).map(
        lambda text: ("text", text)),
    st.integers(FRAME_LIMIT - 10, 4 * FRAME_LIMIT).map(
        lambda size: ("text", '{"type": "generate", "system": "' + "x" * size + '"}')),
    st.binary(max_size=64).map(lambda data: ("bytes", data)),
    st.integers(FRAME_LIMIT, 4 * FRAME_LIMIT).map(lambda size: ("bytes", b"\x00" * size)),
)


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    started = start_fake_engine("fuzz-ws-1", interval_ms=0)
    yield started
    started.process.kill()
    started.process.wait(timeout=10)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    yield from private_loop()


@pytest.fixture(autouse=True)
def socket_settings(settings: Any) -> None:
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.WEBSOCKET_MESSAGES_PER_SECOND = 100_000  # the fuzz, not the rate limit
    settings.WEBSOCKET_MAX_MESSAGE_BYTES = FRAME_LIMIT
    settings.USAGE_FLUSH_SECONDS = 0.1


class Socket:
    """One socket to `path`, opened again when the server closes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, path: str, user: Any) -> None:
        self.loop, self.path, self.user = loop, path, user
        self.communicator: WebsocketCommunicator | None = None

    async def open(self) -> WebsocketCommunicator:
        communicator = WebsocketCommunicator(application, self.path)
        communicator.scope["user"] = self.user
        connected, code = await communicator.connect()
        assert connected, code
        return communicator

    def answers(self, kind: str, data: Any) -> list[dict[str, Any]]:
        """Send one frame, then a ping; what came back up to the pong."""
        return self.loop.run_until_complete(self._answers(kind, data))

    async def _answers(self, kind: str, data: Any) -> list[dict[str, Any]]:
        if self.communicator is None:
            self.communicator = await self.open()
        communicator = self.communicator
        await communicator.send_to(**{f"{kind}_data": data})
        await communicator.send_to(text_data='{"type": "ping"}')
        seen: list[dict[str, Any]] = []
        while not seen or seen[-1] != {"type": "pong"}:
            # An exception in the consumer is raised here, by the communicator.
            output = await communicator.receive_output(10)
            if output["type"] == "websocket.close":
                assert output.get("code", 1000) >= 1000, output
                self.communicator = None
                return [*seen, {"type": "closed", "code": output.get("code", 1000)}]
            assert output["type"] == "websocket.send", output
            seen.append(orjson.loads(output["text"]))
        return seen

    def close(self) -> None:
        if self.communicator is not None:
            self.loop.run_until_complete(self.communicator.disconnect())


def check(answers: list[dict[str, Any]]) -> None:
    for answer in answers:
        assert isinstance(answer.get("type"), str), answer
        assert answer["type"] != "error" or isinstance(answer.get("message"), str), answer


def test_random_frames_never_crash_the_playground(engine: FakeEngine,
                                                  loop: asyncio.AbstractEventLoop) -> None:
    publish("demo", [engine])
    socket = Socket(loop, "/ws/playground/", loop.run_until_complete(make_user()))

    @FUZZ
    @given(frame=frames)
    def fuzz(frame: tuple[str, Any]) -> None:
        check(socket.answers(*frame))

    fuzz()
    assert socket.answers("text", '{"type": "ping"}')[-1] == {"type": "pong"}
    socket.close()


def test_random_frames_never_crash_the_dashboards(loop: asyncio.AbstractEventLoop) -> None:
    user = loop.run_until_complete(make_user())
    fleet = Socket(loop, "/ws/dashboard/", user)

    @FUZZ
    @given(frame=frames)
    def fuzz(frame: tuple[str, Any]) -> None:
        check(fleet.answers(*frame))

    fuzz()
    assert fleet.answers("text", '{"type": "ping"}')[-1] == {"type": "pong"}
    fleet.close()
