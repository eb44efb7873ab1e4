"""Replicas demand a key; the gateway sends it. FAKE engines (fakes/engine.py) started with
a key refuse /v1/* without it exactly as vLLM does; the gateway, handed the key through
the route table, serves through them. The table in Redis (real Redis) holds no key in
clear."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from controlplane.models import Replica
from controlplane.routing import publish_routes
from serving.models import ApiKey
from serving.routes import REDIS_KEY, DeploymentRoutes, RouteReplica, RouteStore, build_table
from tests.engines import FakeEngine, publish
from tests.factories import make_api_key, make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 3}
REDIS_URL = "redis://127.0.0.1:6379/11"  # a database of its own: others use Redis too


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_keyed_replica_refuses_a_request_without_its_key_as_vllm_does(
        fake_engines: Engines) -> None:
    engine = fake_engines("demo-1", key="the-engine-key")
    refused = httpx.post(f"{engine.url}/v1/completions", json=BODY, timeout=10)
    assert refused.status_code == 401
    assert refused.json() == {"error": "Unauthorized"}
    wrong = httpx.post(f"{engine.url}/v1/completions", json=BODY, timeout=10,
                       headers={"Authorization": "Bearer another-key"})
    assert wrong.status_code == 401
    # As in vLLM, /health and /metrics are not guarded by the key.
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{engine.url}/metrics", timeout=10).status_code == 200


def test_the_gateway_serves_through_a_replica_that_demands_a_key(
        gateway_url: str, fake_engines: Engines) -> None:
    engine = fake_engines("demo-1", key="the-engine-key")
    publish("demo", [engine])
    openai_client = client(gateway_url, make_api_key(ApiKey.Scope.INFERENCE))
    answer = openai_client.completions.create(model="fake", prompt="hi", max_tokens=3)
    assert answer.choices[0].text == " tok" * 3
    stream = openai_client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        " tok" * 4)


def test_the_gateway_sends_an_external_endpoint_its_own_api_key(
        gateway_url: str, fake_engines: Engines) -> None:
    remote = fake_engines("remote", key="the-providers-key")
    backend = make_backend("provider", "external", {"url": f"{remote.url}/v1",
                                                    "api_key": "the-providers-key"})
    deployment = make_deployment("fake", model=make_model("remote-model"), backend=backend)
    Replica.objects.create(deployment=deployment, name="fake-1", endpoint=remote.url,
                           phase=Replica.Phase.READY)
    publish_routes()
    answer = client(gateway_url, make_api_key(ApiKey.Scope.INFERENCE)).completions.create(
        model="fake", prompt="hi", max_tokens=2)
    assert answer.choices[0].text == " tok" * 2


def test_the_route_table_in_redis_holds_no_key_in_clear(settings: Any) -> None:
    connection = redis.Redis.from_url(REDIS_URL)
    connection.delete(REDIS_KEY)
    secret = "engine-key-that-must-not-leak"
    table = build_table([DeploymentRoutes(deployment="demo", served_model_name="fake",
                              policy="least-load", max_model_len=2048,
                              replicas=(RouteReplica("demo-1", "http://10.0.0.1:8000",
                                                     secret),))])
    try:
        assert RouteStore().publish(table, REDIS_URL)
        stored = connection.get(REDIS_KEY)
        assert isinstance(stored, bytes)
        text = stored.decode()
        assert secret not in text
        assert "http://10.0.0.1:8000" in text  # the topology stays readable
        gateway_side = RouteStore()  # another process of the same install
        gateway_side.load_json(text)
        [replica] = gateway_side.table.pools["fake"].replicas
        assert replica.key == secret
        assert secret not in repr(replica)
        settings.SECRET_KEY = "another-install-entirely-0123456789-abcdefghijklmnopqrstuvwxyz"
        stranger = RouteStore()
        stranger.load_json(text)  # another install cannot open it: ignored
        assert stranger.table.pools == {}
    finally:
        connection.delete(REDIS_KEY)


def test_a_deployments_key_is_not_shown_by_the_api_the_page_or_the_audit_log(
        admin_client: Any, django_user_model: Any) -> None:
    from django.test import Client

    from controlplane.models import AuditEvent, Deployment

    make_model("smollm2")
    created = admin_client.post("/api/v1/deployments/", {
        "name": "demo", "model": "smollm2", "replicas": 1}, format="json")
    assert created.status_code == 201, created.json()
    deployment = Deployment.objects.get(name="demo")
    key = deployment.engine_key()
    assert key and key not in created.content.decode()
    assert key not in admin_client.get("/api/v1/deployments/demo/").content.decode()
    assert deployment.engine_key_sealed not in created.content.decode()
    admin_client.patch("/api/v1/deployments/demo/", {"replicas": 2}, format="json")
    for event in AuditEvent.objects.all():
        assert key not in f"{event.message} {event.before} {event.after}"
        assert deployment.engine_key_sealed not in f"{event.before} {event.after}"
    person = Client()
    person.force_login(django_user_model.objects.create_superuser("root", "r@x.io", "pw"))
    for path in ("/deployments/demo/", f"/admin/controlplane/deployment/{deployment.pk}/change/"):
        page = person.get(path)
        assert page.status_code == 200, path
        assert key not in page.content.decode()
        assert deployment.engine_key_sealed not in page.content.decode()
