"""Session and prefix affinity through HTTP, as docs/gateway.md promises them: the same
`user` field, the same `X-Session-Id` header or a long shared prompt prefix lands on one
replica, and a burst of one session spreads over the replicas once the home replica
would carry more than 1.25 x the pool's average. The official `openai` client in front of
FAKE engines (fakes/engine.py), each counting the requests it served."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable

import openai
import pytest

from serving.models import ApiKey
from serving.router import LOAD_BOUND
from tests.factories import make_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]
SHARED = ("You are a careful assistant for a travel agency. Answer in two sentences, name "
          "the source of every figure, never invent a price, and say so when you do not "
          "know. The customer's booking history follows, then their question. History: "
          "three flights to Lisbon, one to Oslo, a rail pass for Austria, two hotel nights "
          "in Porto. Question: ")  # longer than the 256 characters the policy reads


@pytest.fixture
def key() -> str:
    return make_api_key(ApiKey.Scope.INFERENCE)


def client(url: str, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60,
                         default_headers=headers)


def served(engines: list[FakeEngine]) -> list[int]:
    return [int(engine.metric("fake:requests_total")) for engine in engines]


# Each test's replicas have names of their own: the gateway's view of a replica's load is
# kept by name, and a previous test's replica of the same name may still count as busy.
SERIAL = itertools.count(1)


def three(fake_engines: Engines) -> list[FakeEngine]:
    serial = next(SERIAL)
    return [fake_engines(f"affinity-{serial}-{n}", interval_ms=1) for n in (1, 2, 3)]


def test_the_same_user_field_lands_on_one_replica(gateway_url: str, key: str,
                                                  fake_engines: Engines) -> None:
    engines = three(fake_engines)
    publish("demo", engines, policy="session")
    for n in range(9):
        client(gateway_url, key).chat.completions.create(
            model="fake", max_tokens=2, user="alice",
            messages=[{"role": "user", "content": f"question {n}"}])
    assert sorted(served(engines)) == [0, 0, 9]


def test_the_same_session_header_lands_on_one_replica(gateway_url: str, key: str,
                                                      fake_engines: Engines) -> None:
    engines = three(fake_engines)
    publish("demo", engines, policy="session")
    session = client(gateway_url, key, **{"X-Session-Id": "cart-4711"})
    for n in range(9):
        session.completions.create(model="fake", prompt=f"step {n}", max_tokens=2)
    assert sorted(served(engines)) == [0, 0, 9]


def test_different_sessions_spread_over_the_replicas(gateway_url: str, key: str,
                                                     fake_engines: Engines) -> None:
    engines = three(fake_engines)
    publish("demo", engines, policy="session")
    for n in range(30):
        client(gateway_url, key).completions.create(model="fake", prompt="hi",
                                                    max_tokens=2, user=f"user-{n}")
    assert sum(served(engines)) == 30
    assert all(count > 0 for count in served(engines))


def test_a_long_shared_prefix_lands_on_one_replica(gateway_url: str, key: str,
                                                   fake_engines: Engines) -> None:
    engines = three(fake_engines)
    publish("demo", engines, policy="prefix")
    for question in ("Is Lisbon warm in May?", "Can I change the Oslo flight?",
                     "What does the rail pass cover?", "Which hotel was it?",
                     "Do I need a visa?", "How much luggage?"):
        client(gateway_url, key).chat.completions.create(
            model="fake", max_tokens=2, messages=[{"role": "user",
                                                    "content": SHARED + question}])
    assert sorted(served(engines)) == [0, 0, 6]


def test_different_prefixes_spread_over_the_replicas(gateway_url: str, key: str,
                                                     fake_engines: Engines) -> None:
    engines = three(fake_engines)
    publish("demo", engines, policy="prefix")
    for n in range(30):
        client(gateway_url, key).completions.create(
            model="fake", max_tokens=2, prompt=f"Document {n}: " + SHARED)
    assert sum(served(engines)) == 30
    assert all(count > 0 for count in served(engines))


def burst(url: str, key: str, streams: int, **fields: str) -> None:
    """`streams` long streams at once, all with the same `fields`, each read to its end."""
    errors: list[BaseException] = []

    def one() -> None:
        try:
            for _ in client(url, key).completions.create(
                    model="fake", prompt=SHARED, max_tokens=150, stream=True,
                    **fields):  # type: ignore[call-overload]
                pass
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []


@pytest.mark.parametrize("policy", ["session", "prefix"])
def test_one_hot_session_or_prefix_spreads_within_the_load_bound(
    gateway_url: str, key: str, fake_engines: Engines, policy: str
) -> None:
    # 8 streams of 3 s each, all placed while the others run: the home replica takes a
    # stream only while its load stays within 1.25 x the pool's average.
    engines = [fake_engines(f"hot-{n}", interval_ms=20) for n in (1, 2)]
    publish("demo", engines, policy=policy)
    burst(gateway_url, key, 8, user="hot-user")
    counts = served(engines)
    assert sum(counts) == 8
    assert min(counts) > 0
    assert max(counts) <= math.ceil(LOAD_BOUND * 8 / 2)
