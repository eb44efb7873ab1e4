"""The deployments API, bad input first: a 4xx naming the field, and nothing changed."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.models import AuditEvent, Backend, Deployment
from models_registry.models import Model
from tests.factories import make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db
URL = "/api/v1/deployments/"


def create(client: APIClient, **body: Any) -> Any:
    payload = {"name": "demo", "model": "smollm2", "replicas": 1, **body}
    return client.post(URL, payload, format="json")


@pytest.fixture
def model() -> Model:
    return make_model("smollm2")


def test_creating_a_deployment_records_it_and_an_event(admin_client: APIClient,
                                                       model: Model) -> None:
    response = create(admin_client, engine_args={"max_model_len": 2048})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["backend"] == "local"
    assert body["engine_args"] == {"max_model_len": 2048}
    assert body["generation"] == 1
    assert Backend.objects.get(name="local").kind == "local"
    assert AuditEvent.objects.filter(action="deployment-created").count() == 1


def test_a_model_that_is_not_ready_cannot_be_deployed(admin_client: APIClient) -> None:
    make_model("smollm2", status=Model.Status.IMPORTING)
    response = create(admin_client)
    assert response.status_code == 400
    assert "not ready" in response.json()["model"][0]
    assert Deployment.objects.count() == 0


def test_a_duplicate_name_is_a_conflict(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    response = create(admin_client)
    assert response.status_code == 409
    assert "already exists" in response.json()["detail"]
    assert Deployment.objects.count() == 1


def test_unknown_engine_args_are_refused(admin_client: APIClient, model: Model) -> None:
    response = create(admin_client, engine_args={"turbo": True})
    assert response.status_code == 400
    assert "turbo" in response.json()["engine_args"]
    assert Deployment.objects.count() == 0


def test_args_that_cannot_work_with_the_model_are_refused_with_the_reason(
    admin_client: APIClient, model: Model
) -> None:
    response = create(admin_client, engine_args={"max_model_len": 65536})
    assert response.status_code == 400
    assert "above the context length" in response.json()["engine_args.max_model_len"][0]
    response = create(admin_client, engine_args={"tensor_parallel_size": 4})
    assert "does not divide" in response.json()["engine_args.tensor_parallel_size"][0]
    assert Deployment.objects.count() == 0


def test_a_model_name_another_deployment_answers_to_is_refused(admin_client: APIClient,
                                                               model: Model) -> None:
    make_deployment("other", model=model)
    response = create(admin_client, aliases=["other"])
    assert response.status_code == 400
    assert "already used by deployment other" in response.json()["aliases"][0]
    assert Deployment.objects.count() == 1


def test_replicas_outside_min_and_max_are_refused(admin_client: APIClient,
                                                  model: Model) -> None:
    response = create(admin_client, replicas=5, max_replicas=4)
    assert response.status_code == 400
    assert "replicas" in response.json()


@pytest.mark.parametrize(("replicas", "message"), [(5, "above max_replicas"),
                                                   (-1, "greater than or equal to 0")])
def test_scaling_outside_the_bounds_changes_nothing(admin_client: APIClient, model: Model,
                                                    replicas: int, message: str) -> None:
    make_deployment("demo", model=model, replicas=1, max_replicas=4)
    response = admin_client.post(f"{URL}demo/scale/", {"replicas": replicas}, format="json")
    assert response.status_code == 400
    assert message in response.json()["replicas"][0]
    assert Deployment.objects.get().replicas == 1


def test_scaling_sets_the_desired_count(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model, replicas=1, max_replicas=4)
    response = admin_client.post(f"{URL}demo/scale/", {"replicas": 2}, format="json")
    assert response.status_code == 200
    assert response.json()["replicas"] == 2
    assert AuditEvent.objects.filter(action="deployment-scaled").get().after == {"replicas": 2}


def test_stop_and_start_change_the_state(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    assert admin_client.post(f"{URL}demo/stop/").json()["state"] == "stopped"
    assert admin_client.post(f"{URL}demo/start/").json()["state"] == "running"


def test_a_restart_starts_a_new_generation(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    assert admin_client.post(f"{URL}demo/restart/").json()["generation"] == 2


def test_changing_engine_args_starts_a_rollout(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    response = admin_client.patch(f"{URL}demo/", {"engine_args": {"max_num_seqs": 8}},
                                  format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["generation"] == 2
    response = admin_client.patch(f"{URL}demo/", {"replicas": 2}, format="json")
    assert response.json()["generation"] == 2


def test_deleting_drains_first(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    response = admin_client.delete(f"{URL}demo/")
    assert response.status_code == 202
    assert response.json()["deleting"] is True
    assert Deployment.objects.get().desired_replicas() == 0


def test_a_model_in_use_cannot_be_deleted(admin_client: APIClient, model: Model) -> None:
    make_deployment("demo", model=model)
    response = admin_client.delete("/api/v1/models/smollm2/")
    assert response.status_code == 409
    assert "demo" in response.json()["detail"]


def test_an_external_backend_needs_an_http_url(admin_client: APIClient) -> None:
    response = admin_client.post("/api/v1/backends/", {"name": "ext", "kind": "external",
                                                       "config": {"url": "ftp://x"}},
                                 format="json")
    assert response.status_code == 400
    assert "url" in response.json()["config"][0]
    assert Backend.objects.count() == 0


@pytest.mark.parametrize(("config", "field"), [
    ({"url": "http://127.0.0.1:9", "api_key": "sk-\u00e9t\u00e9"}, "api_key"),
    ({"url": "http://127.0.0.1:9", "api_key": "sk-1\r\nX-Injected: 1"}, "api_key"),
    ({"url": "http://127.0.0.1:9", "api_key": "two words"}, "api_key"),
    ({"url": "http://\u00fcber.example/v1"}, "url"),
    ({"url": "http://127.0.0.1:9/v1 "}, "url"),
])
def test_an_external_backend_refuses_what_cannot_be_sent_in_a_request(
        admin_client: APIClient, config: dict[str, str], field: str) -> None:
    response = admin_client.post("/api/v1/backends/", {"name": "ext", "kind": "external",
                                                       "config": config}, format="json")
    assert response.status_code == 400
    assert field in response.json()["config"][0]
    assert Backend.objects.count() == 0


def test_an_external_backend_hides_its_key(admin_client: APIClient) -> None:
    response = admin_client.post("/api/v1/backends/", {
        "name": "ext", "kind": "external",
        "config": {"url": "http://127.0.0.1:9/v1", "api_key": "secret"}}, format="json")
    assert response.status_code == 201
    assert response.json()["config"] == {"url": "http://127.0.0.1:9", "api_key": "***"}


def test_an_unknown_local_backend_setting_is_refused(admin_client: APIClient) -> None:
    response = admin_client.post("/api/v1/backends/", {
        "name": "gpu", "kind": "local", "config": {"gpus": 8}}, format="json")
    assert response.status_code == 400
    assert "gpus" in response.json()["config"][0]


def test_an_inference_key_cannot_manage_deployments(inference_client: APIClient) -> None:
    assert inference_client.get(URL).status_code == 403


def test_events_of_a_deployment_are_listed(admin_client: APIClient, model: Model) -> None:
    create(admin_client)
    admin_client.post(f"{URL}demo/scale/", {"replicas": 2}, format="json")
    page = admin_client.get(f"{URL}demo/events/", {"limit": 1}).json()
    assert [e["action"] for e in page["results"]] == ["deployment-scaled"]
    assert page["count"] == 2 and page["next"]


def test_backends_are_listed(admin_client: APIClient) -> None:
    make_backend("edge", "external", {"url": "http://127.0.0.1:9"})
    names = [b["name"] for b in admin_client.get("/api/v1/backends/").json()["results"]]
    assert names == ["edge"]


def test_a_replica_log_is_read_from_its_end(admin_client: APIClient, model: Model,
                                            tmp_path: Any) -> None:
    from controlplane.models import Replica

    log = tmp_path / "demo-1.log"
    log.write_text("".join(f"line {n}\n" for n in range(1, 1001)))
    Replica.objects.create(deployment=make_deployment("demo", model=model), name="demo-1",
                           log_path=str(log))
    body = admin_client.get("/api/v1/replicas/demo-1/logs/", {"lines": "3"}).json()
    assert body["lines"] == ["line 998", "line 999", "line 1000"]
    assert admin_client.get("/api/v1/replicas/demo-1/logs/",
                            {"lines": "0"}).status_code == 400


def test_the_deployment_pages_list_and_show_a_deployment(model: Model,
                                                         django_user_model: Any) -> None:
    from django.test import Client

    from controlplane.models import Replica

    deployment = make_deployment("demo", model=model)
    Replica.objects.create(deployment=deployment, name="demo-1", phase="failed",
                           last_error="demo-1 exited; last log lines:\nValueError: bad")
    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    listing = client.get("/deployments/").content.decode()
    assert 'href="/deployments/demo/"' in listing
    page = client.get("/deployments/demo/").content.decode()
    assert 'data-replica="demo-1" data-phase="failed"' in page
    response = client.post("/deployments/demo/scale/", {"replicas": "9"}, follow=True)
    assert "above max_replicas" in response.content.decode()
    assert Replica.objects.count() == 1
