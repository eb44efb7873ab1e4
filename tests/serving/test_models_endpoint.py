"""GET /v1/models/{id}: the official `openai` client's `models.retrieve`, against the
gateway in this process with FAKE engines (fakes/engine.py) behind its route table."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from serving.services import create_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_model_is_retrieved_as_it_is_listed(gateway_url: str,
                                              fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")], names=("fake", "demo", "alias"))
    _, key = create_api_key("app", "inference")
    listed = {m.id: m for m in client(gateway_url, key).models.list()}
    model = client(gateway_url, key).models.retrieve("alias")
    assert model.id == "alias" and model.object == "model"
    assert model.owned_by == listed["alias"].owned_by
    assert model.model_dump(exclude={"created"}) == listed["alias"].model_dump(
        exclude={"created"})
    assert model.model_extra == {"root": "fake", "max_model_len": 2048, "ready_replicas": 1}


def test_an_unknown_model_is_a_404_in_openais_shape(gateway_url: str,
                                                    fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    _, key = create_api_key("app", "inference")
    with pytest.raises(openai.NotFoundError) as missing:
        client(gateway_url, key).models.retrieve("no-such-model")
    error = missing.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-model" in error["message"]


def test_a_model_the_key_may_not_use_looks_like_one_that_does_not_exist(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    _, key = create_api_key("other", "inference", models=["another-model"])
    with pytest.raises(openai.NotFoundError) as hidden:
        client(gateway_url, key).models.retrieve("fake")
    with pytest.raises(openai.NotFoundError) as missing:
        client(gateway_url, key).models.retrieve("absent")
    assert hidden.value.response.json()["error"] == {
        **missing.value.response.json()["error"],
        "message": "The model `fake` does not exist."}


def test_retrieving_a_model_without_a_key_is_a_401(gateway_url: str,
                                                   fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    answer = httpx.get(f"{gateway_url}/v1/models/fake", timeout=10)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(gateway_url, "fp-not-a-key").models.retrieve("fake")
