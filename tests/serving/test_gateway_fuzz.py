"""A fuzz of /v1/* (hypothesis): random bodies, headers, JSON of every type at every
field, unicode (lone surrogates, NULs, right-to-left marks), huge numbers, deep nesting,
bytes that are not JSON. Every answer is below 500, and every error is in OpenAI's shape.

The gateway's ASGI application runs in this process (httpx's ASGI transport), with a
FAKE engine (fakes/engine.py, a real HTTP server answering at once) behind its route
table. Examples are derandomized and bounded, so `make test` runs the same cases every
time in about a minute. More: FUZZ_EXAMPLES=2000 (and FUZZ_RANDOM=1 for new cases).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.gateway import gateway
from serving.services import create_api_key
from tests.engines import FakeEngine, start_fake_engine
from tests.private_loop import private_loop
from tests.serving.conftest import publish

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "800"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=not os.environ.get("FUZZ_RANDOM"),
                deadline=None, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
FIELDS = ["model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "n", "temperature", "top_p", "user", "priority", "stop",
          "seed", "logprobs", "response_format", "tools", "encoding_format"]

# Text with what breaks naive code: NUL, right-to-left marks, lone surrogates, emoji.
awkward_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "a\x00b", "\u202eevil\u202c", "\u05e9\u05dc\u05d5\u05dd",
                     "\ud800", "x\udfffy", "\U0001f600" * 3, " " * 3, "fake", "fake\x00"]),
)
huge_numbers = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**64), 10**30, 1e308,
                                float("inf"), float("-inf"), float("nan"), -0.0, 1e-320])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 64), huge_numbers,
                    st.floats(-3, 3), awkward_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(awkward_text, inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(
    ["user", "assistant", "system", "tool", "", "x"]) | json_values,
    "content": awkward_text | json_values}), max_size=3)
field_values = {
    "model": st.sampled_from(["fake", "demo", "absent"]) | json_values,
    "messages": messages | json_values,
    "prompt": awkward_text | st.lists(st.integers(0, 50000), max_size=5) | json_values,
    "input": awkward_text | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "max_tokens": st.integers(1, 8) | json_values,
    "n": st.integers(1, 3) | json_values,
}
# Mostly a request that would be served, with a few fields changed, added or taken out:
# so the fuzz reaches past the first check into the engine and back.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "fake", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2},
    "/v1/embeddings": {"model": "fake", "input": "hi"},
}
changes = st.dictionaries(
    st.sampled_from(FIELDS) | awkward_text,
    st.sampled_from(FIELDS).flatmap(lambda name: field_values.get(name, json_values)),
    max_size=3)


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(changes, st.sets(st.sampled_from(FIELDS), max_size=1)).map(
        lambda found: {name: value for name, value in {**VALID[path], **found[0]}.items()
                       if name not in found[1]})


def encode(value: Any) -> bytes:
    """JSON text as a client might send it: NaN and Infinity as Python writes them, lone
    surrogates as \\u escapes, integers of any size."""
    return json.dumps(value, allow_nan=True).encode()


deep = st.integers(100, 100_000).map(lambda depth: b"[" * depth + b"]" * depth) | \
    st.integers(100, 5000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth)
not_json = st.binary(max_size=64) | st.sampled_from(
    [b"", b"null", b"[]", b'"text"', b"1e309", b"-1e309", b"18446744073709551616",
     b'{"model": "fake"', b'{"model": "fake"}}', b"\xff\xfe{}", b'{"model": "\\ud800"}',
     b"\x00" * 16])


def raw_bodies(path: str) -> st.SearchStrategy[bytes]:
    return st.one_of(bodies(path).map(encode), bodies(path).map(encode), deep, not_json)

header_values = st.binary(max_size=60).map(
    lambda value: value.replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b""))


def authorizations(key: str) -> st.SearchStrategy[bytes]:
    good = key.encode()
    return st.one_of(st.just(b"Bearer " + good), st.just(b"Bearer " + good), header_values,
                     st.sampled_from([
                         b"bearer " + good, b"Bearer  " + good, b"Bearer " + good + b"x",
                         b"Bearer " + good[:-1], b"Bearer", b"Bearer ", b"Basic " + good,
                         good, b"Bearer " + good + b" extra", b"Bearer \xff\xfe",
                         b"Bearer fp-" + b"A" * 43, b""]))


def request_headers(key: str) -> st.SearchStrategy[dict[str, bytes]]:
    return st.fixed_dictionaries({"authorization": authorizations(key)}, optional={
        "x-request-id": header_values | st.sampled_from(
            [b"a" * 100, b"b" * 101, b"c" * 200, b"d" * 201, b"\xe9t\xe9", b"id with spaces",
             b"\x7f", b"\t"]),
        "x-priority": header_values | st.sampled_from(
            [b"batch", b"standard", b"critical", b"BATCH", b" batch ", b"", b"\xff"]),
        "content-type": header_values | st.sampled_from(
            [b"application/json", b"text/plain", b"multipart/form-data; boundary=x", b""]),
        "content-length": st.sampled_from([b"0", b"1", b"-1", b"abc", b"99999999999999",
                                           b"1e3", b" 5", b"\xb9"]),
        "x-session-id": header_values,
    })


def assert_openai_shaped(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code < 400:
        return
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert "param" in error and "code" in error, error


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    started = start_fake_engine("fuzz-1", interval_ms=0)
    yield started
    started.process.kill()
    started.process.wait(timeout=10)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for every example of a test: the gateway keeps its connections,
    usage writer and queues per loop."""
    yield from private_loop()


@pytest.fixture
def fuzzed(engine: FakeEngine, loop: asyncio.AbstractEventLoop,
           settings: Any) -> Iterator[tuple[str, Any]]:
    publish("demo", [engine])
    _, key = create_api_key("fuzz", "inference")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway),  # type: ignore[arg-type]
                               base_url="http://gateway.test", timeout=30)

    def call(method: str, path: str, body: bytes | None = None,
             headers: dict[str, bytes] | None = None) -> httpx.Response:
        raw = [(name.encode(), value) for name, value in (headers or {}).items()]
        return loop.run_until_complete(client.request(method, path, content=body,
                                                      headers=raw))

    yield key, call
    loop.run_until_complete(client.aclose())


def test_random_bodies_get_no_5xx_and_every_error_in_openais_shape(
        fuzzed: tuple[str, Any], settings: Any) -> None:
    key, call = fuzzed
    headers = {"authorization": f"Bearer {key}".encode()}

    @FUZZ
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(ENDPOINTS))
        body = data.draw(raw_bodies(path))
        assert_openai_shaped(call("POST", path, body, headers))

    fuzz()
    assert call("POST", "/v1/completions", b'{"model": "fake", "prompt": "hi", '
                b'"max_tokens": 2}', headers).status_code == 200  # still serving


def test_random_headers_get_no_5xx_and_every_error_in_openais_shape(
        fuzzed: tuple[str, Any], settings: Any) -> None:
    key, call = fuzzed
    # Failed keys would hold this address off with 429 (in OpenAI's shape too) and hide
    # the rest of the request from the fuzz.
    settings.GATEWAY_AUTH_FAILURES_PER_MINUTE = 0

    @FUZZ
    @given(path=st.sampled_from(ENDPOINTS), headers=request_headers(key),
           stream=st.booleans())
    def fuzz(path: str, headers: dict[str, bytes], stream: bool) -> None:
        body = encode({**VALID[path], "stream": stream})
        assert_openai_shaped(call("POST", path, body, headers))

    fuzz()


def test_random_paths_methods_and_model_ids_get_no_5xx_and_openai_errors(
        fuzzed: tuple[str, Any]) -> None:
    key, call = fuzzed
    headers = {"authorization": f"Bearer {key}".encode()}
    paths = st.one_of(
        st.sampled_from(["/v1/models", "/v1/models/", "/v1/models/fake", "/v1/models/demo",
                         "/v1/models/absent", "/v1/models/fake/extra", "/v1/", "/v1/x",
                         "/v1/chat/completions/", "/v1/embeddings", "/v1/models//fake"]),
        st.text(st.characters(blacklist_categories=["Cs", "Cc"]), max_size=30).map(
            lambda name: "/v1/models/" + name),
    )

    @FUZZ
    @given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD",
                                   "OPTIONS"]),
           path=paths, body=st.none() | raw_bodies("/v1/completions"))
    def fuzz(method: str, path: str, body: bytes | None) -> None:
        response = call(method, path, body, headers)
        if method == "HEAD":
            assert response.status_code < 500
        else:
            assert_openai_shaped(response)

    fuzz()
