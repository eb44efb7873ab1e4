"""The REST API's lists at fleet size: a default page that stays small (a deployment's
replicas are on its own endpoint, not in the list), and filter and search parameters that
narrow each list or are a 400 naming what is wrong."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.models import AuditEvent, Deployment, Replica
from models_registry.models import Model
from serving.models import ApiKey
from serving.services import create_api_key, revoke_api_key
from tests.factories import make_backend, make_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def thousand(db: None) -> None:
    """1,000 deployments with two replicas each (one ready), on two models and backends."""
    models = [make_model("alpha"), make_model("beta")]
    backends = [make_backend("edge", "external", {"url": "http://127.0.0.1:9"}),
                make_backend("core")]
    Deployment.objects.bulk_create([Deployment(
        name=f"fleet-{i:04d}", model=models[i % 2], backend=backends[i % 2],
        state="stopped" if i % 10 == 0 else "running",
        conditions=[{"type": "Available", "status": "True", "message": "1 of 1 ready",
                     "last_transition": "2026-11-29T08:00:28Z"}]) for i in range(1000)])
    Replica.objects.bulk_create([
        Replica(deployment=deployment, name=f"{deployment.name}-{n}",
                endpoint="http://127.0.0.1:9", phase="ready" if n == 1 else "failed",
                last_error="refused" * 10)
        for deployment in Deployment.objects.all() for n in (1, 2)])


def names(page: dict[str, Any]) -> list[str]:
    return [row["name"] for row in page["results"]]


def test_the_default_deployment_page_of_a_thousand_stays_small(admin_client: APIClient,
                                                               thousand: None) -> None:
    response = admin_client.get("/api/v1/deployments/")
    page = response.json()
    assert page["count"] == 1000 and len(page["results"]) == 50
    assert len(response.content) < 100_000
    first = page["results"][0]
    assert "replica_list" not in first and first["ready_replicas"] == 1
    assert "offset=50" in page["next"]
    detail = admin_client.get("/api/v1/deployments/fleet-0000/").json()
    assert [r["name"] for r in detail["replica_list"]] == ["fleet-0000-1", "fleet-0000-2"]
    assert detail["ready_replicas"] == 1


def test_every_default_page_of_a_thousand_stays_under_100_kb(admin_client: APIClient,
                                                             thousand: None) -> None:
    Model.objects.bulk_create([Model(name=f"m-{i:04d}", source="local", path="/m",
                                     architecture="LlamaForCausalLM") for i in range(1000)])
    for number in range(60):
        create_api_key(f"key-{number}", "inference")
    for path in ("/api/v1/models/", "/api/v1/replicas/", "/api/v1/backends/",
                 "/api/v1/events/", "/api/v1/keys/"):
        response = admin_client.get(path)
        assert response.status_code == 200 and len(response.content) < 100_000, path


def test_deployments_are_searched_and_filtered(admin_client: APIClient,
                                               thousand: None) -> None:
    assert names(admin_client.get("/api/v1/deployments/", {"search": "FLEET-099"}).json()
                 ) == [f"fleet-{i:04d}" for i in range(990, 1000)]
    stopped = admin_client.get("/api/v1/deployments/", {"state": "stopped", "model": "alpha",
                                                        "limit": "500"}).json()
    assert stopped["count"] == 100 and names(stopped)[:2] == ["fleet-0000", "fleet-0010"]
    by_backend = admin_client.get("/api/v1/deployments/", {"backend": "edge",
                                                           "search": "fleet-000"}).json()
    assert names(by_backend) == [f"fleet-000{i}" for i in range(0, 10, 2)]
    following = admin_client.get("/api/v1/deployments/",
                                 {"search": "fleet-0", "limit": "5"}).json()["next"]
    assert "search=fleet-0" in following and "offset=5" in following


@pytest.mark.parametrize(("path", "query", "param", "message"), [
    ("/api/v1/deployments/", {"state": "sleeping"}, "state",
     "must be one of running, stopped"),
    ("/api/v1/deployments/", {"search": "y" * 101}, "search", "at most 100 characters"),
    ("/api/v1/deployments/", {"search": ["a", "b"]}, "search", "give it once"),
    ("/api/v1/models/", {"status": "asleep"}, "status", "must be one of"),
    ("/api/v1/replicas/", {"phase": "resting"}, "phase", "must be one of"),
    ("/api/v1/keys/", {"state": "lost"}, "state", "must be one of active, revoked, expired"),
    ("/api/v1/backends/", {"kind": "cloud"}, "kind", "must be one of"),
    ("/api/v1/events/", {"replica": "a\x00b"}, "replica", "may not hold NUL characters"),
])
def test_a_filter_that_means_nothing_is_a_400_naming_it(
        admin_client: APIClient, path: str, query: dict[str, Any], param: str,
        message: str) -> None:
    response = admin_client.get(path, query)
    assert response.status_code == 400
    assert message in response.json()[param][0]


def test_replicas_events_models_and_keys_are_filtered(admin_client: APIClient,
                                                      thousand: None) -> None:
    ready = admin_client.get("/api/v1/replicas/", {"phase": "ready", "search": "fleet-012"})
    assert names(ready.json()) == [f"fleet-012{i}-1" for i in range(10)]
    assert names(admin_client.get("/api/v1/replicas/", {"deployment": "fleet-0003"}).json()
                 ) == ["fleet-0003-1", "fleet-0003-2"]
    deployment = Deployment.objects.get(name="fleet-0003")
    AuditEvent.objects.create(deployment=deployment, actor="reconciler",
                              action="replica-unreachable", replica_name="fleet-0003-2",
                              message="refused")
    events = admin_client.get("/api/v1/events/", {"replica": "fleet-0003-2"}).json()
    assert [e["message"] for e in events["results"]] == ["refused"]
    assert names(admin_client.get("/api/v1/models/", {"search": "ALP"}).json()) == ["alpha"]
    create_api_key("kept", "inference")
    create_api_key("gone", "inference")
    revoke_api_key(ApiKey.objects.get(name="gone"))
    assert names(admin_client.get("/api/v1/keys/", {"state": "revoked"}).json()) == ["gone"]
    assert names(admin_client.get("/api/v1/keys/", {"state": "active",
                                                    "search": "EPT"}).json()) == ["kept"]
    assert names(admin_client.get("/api/v1/keys/", {"state": "active",
                                                    "search": "gone"}).json()) == []
