"""Secrets in backend configs, URLs with credentials and `env` maps are never shown back:
not by the REST API, not on the pages, not in the audit log; and a config sent back with
its secrets masked keeps the stored ones."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.models import AuditEvent, Backend, Replica
from models_registry.models import Model
from tests.factories import make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db

SECRETS = ("hunter2", "sk-upstream-secret", "tok-in-query", "hf_secret_token", "db-password")
EXTERNAL = {"url": "https://bob:hunter2@llm.example.com?token=tok-in-query&region=eu",
            "api_key": "sk-upstream-secret"}
LOCAL = {"env": {"HF_TOKEN": "hf_secret_token", "PGPASSWORD": "db-password",
                 "OMP_NUM_THREADS": "2"}}


def assert_no_secret(text: str) -> None:
    assert not [secret for secret in SECRETS if secret in text], text


@pytest.fixture
def backends(admin_client: APIClient) -> list[Any]:
    return [admin_client.post("/api/v1/backends/", body, format="json") for body in (
        {"name": "edge", "kind": "external", "config": EXTERNAL},
        {"name": "box", "kind": "local", "config": LOCAL})]


def test_a_backend_config_is_shown_with_its_secrets_masked(admin_client: APIClient,
                                                           backends: list[Any]) -> None:
    assert [answer.status_code for answer in backends] == [201, 201]
    listed = admin_client.get("/api/v1/backends/").json()["results"]
    configs = {backend["name"]: backend["config"] for backend in listed}
    assert configs["edge"] == {
        "url": "https://bob:***@llm.example.com?token=***&region=eu", "api_key": "***"}
    assert configs["box"]["env"] == {"HF_TOKEN": "***", "PGPASSWORD": "***",
                                     "OMP_NUM_THREADS": "***"}
    assert_no_secret(json.dumps([answer.json() for answer in backends]) + json.dumps(listed))
    # Stored as given: the replicas need them.
    assert Backend.objects.get(name="edge").config["api_key"] == "sk-upstream-secret"


def test_the_audit_log_holds_no_secret(admin_client: APIClient, backends: list[Any]) -> None:
    admin_client.patch("/api/v1/backends/edge/", {"config": {
        **EXTERNAL, "url": "https://bob:hunter3@llm.example.com"}}, format="json")
    stored = [[event.message, event.before, event.after]
              for event in AuditEvent.objects.filter(action__startswith="backend-")]
    assert len(stored) == 3
    assert_no_secret(json.dumps(stored))
    assert "hunter3" not in json.dumps(stored)
    assert_no_secret(json.dumps(admin_client.get("/api/v1/events/").json()))


def test_a_config_sent_back_as_shown_keeps_its_secrets(admin_client: APIClient,
                                                       backends: list[Any]) -> None:
    shown = admin_client.get("/api/v1/backends/edge/").json()["config"]
    moved = {**shown, "url": shown["url"].replace("llm.example.com", "llm2.example.com")}
    answer = admin_client.patch("/api/v1/backends/edge/", {"config": moved}, format="json")
    assert answer.status_code == 200, answer.json()
    assert Backend.objects.get(name="edge").config == {
        "url": "https://bob:hunter2@llm2.example.com?token=tok-in-query&region=eu",
        "api_key": "sk-upstream-secret"}
    box = admin_client.get("/api/v1/backends/box/").json()["config"]
    admin_client.patch("/api/v1/backends/box/", {"config": {
        **box, "env": {**box["env"], "OMP_NUM_THREADS": "4"}}}, format="json")
    assert Backend.objects.get(name="box").config["env"] == {
        "HF_TOKEN": "hf_secret_token", "PGPASSWORD": "db-password", "OMP_NUM_THREADS": "4"}


@pytest.fixture
def replica(db: None) -> Replica:
    backend = make_backend("edge", "external", EXTERNAL)
    deployment = make_deployment("demo", model=make_model("demo"), backend=backend,
                                 conditions=[{"type": "Degraded", "status": "True",
                                              "message": f"GET {EXTERNAL['url']}: 401"}])
    return Replica.objects.create(
        deployment=deployment, name="demo-0", endpoint=EXTERNAL["url"],
        last_error=f"cannot reach {EXTERNAL['url']}: connection refused")


def test_a_replica_and_its_deployment_show_no_credentials_in_the_api(
        admin_client: APIClient, replica: Replica) -> None:
    answers = [admin_client.get(url).json() for url in (
        "/api/v1/replicas/demo-0/", "/api/v1/deployments/demo/", "/api/v1/deployments/")]
    assert answers[0]["endpoint"] == "https://bob:***@llm.example.com?token=***&region=eu"
    assert_no_secret(json.dumps(answers))


def test_the_deployment_page_shows_no_credentials(replica: Replica,
                                                  django_user_model: Any) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    page = client.get("/deployments/demo/").content.decode()
    assert "bob:***@llm.example.com" in page
    assert_no_secret(page)


def test_the_django_admin_shows_backends_replicas_and_deployments_without_secrets(
        replica: Replica, django_user_model: Any) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    backend = Backend.objects.get(name="edge")
    pages = [client.get(url) for url in (
        "/admin/controlplane/backend/", f"/admin/controlplane/backend/{backend.pk}/change/",
        "/admin/controlplane/replica/", f"/admin/controlplane/replica/{replica.pk}/change/",
        f"/admin/controlplane/deployment/{replica.deployment_id}/change/")]
    assert [page.status_code for page in pages] == [200] * 5
    text = "".join(page.content.decode() for page in pages)
    assert "bob:***@llm.example.com" in text
    assert_no_secret(text)
    # Shown, not edited there: a change would skip the allow-lists and the audit log.
    assert client.post(f"/admin/controlplane/backend/{backend.pk}/change/",
                       {"name": "edge", "kind": "external"}).status_code == 403


def test_the_django_admin_refuses_changes_to_deployments_models_and_the_audit_log(
        replica: Replica, django_user_model: Any) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    deployment = replica.deployment
    model = deployment.model
    Model.objects.filter(pk=model.pk).update(source_uri=EXTERNAL["url"],
                                             error=f"GET {EXTERNAL['url']}: 401")
    event = AuditEvent.objects.create(
        actor="root", action="backend-updated", deployment=deployment,
        message=f"moved to {EXTERNAL['url']}", before={"config": EXTERNAL},
        after={"config": {**EXTERNAL, "url": "https://bob:hunter2@llm2.example.com"}})
    # A change here would skip engine-args validation (--trust-remote-code, --api-key),
    # the model import roots and the audit log; an audit event is never rewritten.
    refused = [
        client.post(f"/admin/controlplane/deployment/{deployment.pk}/change/", {
            "name": "demo", "engine_args": '{"extra_args": ["--trust-remote-code"]}'}),
        client.post(f"/admin/models_registry/model/{model.pk}/change/", {
            "name": model.name, "path": "/etc"}),
        client.post(f"/admin/controlplane/auditevent/{event.pk}/change/", {
            "actor": "someone-else", "message": "nothing happened"}),
        client.post(f"/admin/controlplane/auditevent/{event.pk}/delete/", {"post": "yes"}),
    ]
    assert [answer.status_code for answer in refused] == [403] * 4
    deployment.refresh_from_db()
    assert "extra_args" not in deployment.engine_args
    assert Model.objects.get(pk=model.pk).path != "/etc"
    assert AuditEvent.objects.get(pk=event.pk).actor == "root"
    pages = [client.get(url) for url in (
        "/admin/controlplane/auditevent/", f"/admin/controlplane/auditevent/{event.pk}/change/",
        f"/admin/models_registry/model/{model.pk}/change/")]
    assert [page.status_code for page in pages] == [200] * 3
    text = "".join(page.content.decode() for page in pages)
    assert "bob:***@llm.example.com" in text
    assert_no_secret(text)
