"""Roles on every surface (REST API, pages), keys, teams and users through the API, and the
audit log of changes to keys, users, deployments and models (who, what, when, before and
after), readable by admins only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from rest_framework.test import APIClient

from controlplane.models import AuditEvent
from serving.models import ApiKey
from serving.services import hash_key
from tests.factories import make_deployment, make_model, write_hf_folder

pytestmark = pytest.mark.django_db


def user_with(role: str | None, name: str | None = None) -> User:
    user = User.objects.create_user(name or f"user-{role}", password="pw-12345678")
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def api_as(role: str | None) -> APIClient:
    client = APIClient()
    client.force_authenticate(user_with(role))
    return client


def page_as(role: str | None) -> Client:
    client = Client()
    client.force_login(user_with(role))
    return client


@pytest.mark.parametrize(("role", "read", "write", "keys"), [
    (None, 403, 403, 403),
    ("viewer", 200, 403, 403),
    ("operator", 200, 201, 403),
    ("admin", 200, 201, 200),
])
def test_the_api_checks_the_role(role: str | None, read: int, write: int, keys: int) -> None:
    model = make_model("llama")
    make_deployment("existing", model=model)
    client = api_as(role)
    assert client.get("/api/v1/deployments/").status_code == read
    created = client.post("/api/v1/deployments/", {"name": "new", "model": "llama"},
                          format="json")
    assert created.status_code == write, created.json()
    assert client.get("/api/v1/keys/").status_code == keys
    assert client.get("/api/v1/users/").status_code == keys
    assert client.get("/api/v1/events/").status_code == keys  # the whole audit log


def test_the_api_schema_needs_a_role() -> None:
    assert APIClient().get("/api/schema/").status_code in (401, 403)
    assert api_as(None).get("/api/schema/").status_code == 403
    assert api_as("viewer").get("/api/schema/").status_code == 200


def test_the_pages_check_the_role() -> None:
    make_deployment("chat", model=make_model("llama"))
    viewer, operator = page_as("viewer"), page_as("operator")
    for path in ("/deployments/", "/deployments/chat/", "/models/", "/dashboard/",
                 "/dashboard/chat/"):
        assert viewer.get(path).status_code == 200, path
    assert viewer.get("/playground/").status_code == 403
    assert viewer.post("/deployments/chat/scale/", {"replicas": 2}).status_code == 403
    assert operator.get("/playground/").status_code == 200
    assert operator.post("/deployments/chat/scale/", {"replicas": 2}).status_code == 302
    assert page_as(None).get("/dashboard/").status_code == 403  # logged in, no role
    assert Client().get("/dashboard/").status_code == 302  # to the login page
    assert operator.get("/keys/").status_code == 403
    assert page_as("admin").get("/keys/").status_code == 200


def test_a_key_is_shown_once_stored_hashed_and_audited(admin_client: APIClient) -> None:
    assert admin_client.post("/api/v1/teams/", {"name": "search", "rpm": 100},
                             format="json").status_code == 201
    created = admin_client.post("/api/v1/keys/", {
        "name": "crawler", "team": "search", "models": ["llama"], "priority": "batch",
        "rpm": 60, "tpm": 20000, "expires_at": "2099-01-01T00:00:00Z"}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    secret = body["key"]
    assert secret.startswith(body["prefix"]) and body["team"] == "search"
    assert (body["rpm"], body["tpm"], body["priority"]) == (60, 20000, "batch")
    record = ApiKey.objects.get(pk=body["id"])
    assert record.key_hash == hash_key(secret) and secret not in str(record.__dict__)
    listed = admin_client.get("/api/v1/keys/").json()["results"]
    assert all("key" not in k for k in listed)  # never again
    revoked = admin_client.post(f"/api/v1/keys/{body['id']}/revoke/").json()
    assert revoked["active"] is False and revoked["revoked_at"]
    events = {e.action: e for e in AuditEvent.objects.filter(action__startswith="key-",
                                                             message__contains="crawler")}
    assert set(events) == {"key-created", "key-revoked"}
    assert events["key-created"].after is not None
    assert events["key-created"].after["team"] == "search"
    assert events["key-revoked"].before is not None
    assert events["key-revoked"].before["revoked_at"] is None
    assert events["key-revoked"].after is not None
    assert events["key-revoked"].after["revoked_at"]
    assert all(secret not in str(e.after) and record.key_hash not in str(e.after)
               for e in events.values())
    assert {e.actor for e in events.values()} == {"key:tests"}  # the admin key used


@pytest.mark.parametrize(("body", "field"), [
    ({"name": ""}, "name"),
    ({"name": "k", "rpm": 0}, "rpm"),
    ({"name": "k", "team": "nobody"}, "team"),
    ({"name": "k", "priority": "urgent"}, "priority"),
    ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ({"name": "k", "scope": "root"}, "scope"),
])
def test_bad_key_requests_are_refused_with_the_field(admin_client: APIClient,
                                                    body: dict[str, Any], field: str) -> None:
    response = admin_client.post("/api/v1/keys/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert not ApiKey.objects.exclude(name="tests").exists()


def test_users_get_roles_and_every_change_is_audited(admin_client: APIClient) -> None:
    created = admin_client.post("/api/v1/users/", {"username": "eve", "role": "operator"},
                                format="json")
    assert created.status_code == 201, created.json()
    password = created.json()["password"]  # made for her, shown once
    assert User.objects.get(username="eve").check_password(password)
    assert admin_client.get("/api/v1/users/eve/").json()["role"] == "operator"
    changed = admin_client.patch("/api/v1/users/eve/", {"role": "admin"}, format="json")
    assert changed.json()["role"] == "admin"
    assert User.objects.get(username="eve").is_staff  # the admin site opens to admins
    admin_client.patch("/api/v1/users/eve/", {"role": "viewer"}, format="json")
    assert not User.objects.get(username="eve").is_staff
    changes = AuditEvent.objects.filter(action="user-role-changed").order_by("id")
    assert [(e.before["role"], e.after["role"]) for e in changes  # type: ignore[index]
            ] == [(None, "operator"), ("operator", "admin"), ("admin", "viewer")]
    assert admin_client.post("/api/v1/users/", {"username": "eve"},
                             format="json").status_code == 409
    assert admin_client.patch("/api/v1/users/eve/", {"role": "god"},
                              format="json").status_code == 400
    root = User.objects.create_superuser("root", password="root-password")
    taken = admin_client.patch("/api/v1/users/root/", {"password": "mine-now-123"},
                               format="json")
    assert taken.status_code == 400 and "superuser" in str(taken.json())
    root.refresh_from_db()
    assert root.check_password("root-password")


def test_changes_to_deployments_and_models_are_audited(admin_client: APIClient,
                                                       models_dir: Path) -> None:
    folder = write_hf_folder(models_dir / "tiny")
    assert admin_client.post("/api/v1/models/", {"name": "tiny", "source": "local",
                                                 "path": str(folder)},
                             format="json").status_code == 201
    assert admin_client.post("/api/v1/deployments/", {"name": "chat", "model": "tiny"},
                             format="json").status_code == 201
    admin_client.patch("/api/v1/deployments/chat/", {"replicas": 2}, format="json")
    admin_client.delete("/api/v1/deployments/chat/")
    make_model("old")
    assert admin_client.delete("/api/v1/models/old/").status_code == 204
    log = admin_client.get("/api/v1/events/").json()["results"]
    actions = [e["action"] for e in reversed(log)]
    for wanted in ("model-registered", "deployment-created", "deployment-updated",
                   "model-deleted"):
        assert wanted in actions, actions
    updated = next(e for e in log if e["action"] == "deployment-updated")
    assert (updated["before"]["replicas"], updated["after"]["replicas"]) == (1, 2)
    assert updated["actor"] == "key:tests" and updated["at"]
    deleted = next(e for e in log if e["action"] == "model-deleted")
    assert deleted["before"]["name"] == "old"
    only_models = admin_client.get("/api/v1/events/", {"action": "model-deleted"}).json()
    assert [e["action"] for e in only_models["results"]] == ["model-deleted"]


@pytest.mark.parametrize(("admission", "field"), [
    ({"replica_concurrency": 0}, "admission.replica_concurrency"),
    ({"long_prompt_tokens": 2048}, "admission.long_replicas"),
    ({"long_prompt_tokens": 2048, "long_replicas": 4}, "admission.long_replicas"),
    ({"speed": 1}, "admission.speed"),
    ("fast", "admission"),
])
def test_bad_admission_settings_are_refused(admin_client: APIClient, admission: Any,
                                            field: str) -> None:
    make_model("llama")
    response = admin_client.post("/api/v1/deployments/", {
        "name": "chat", "model": "llama", "max_replicas": 4, "admission": admission},
        format="json")
    assert response.status_code == 400 and field in response.json(), response.json()


def test_the_route_table_carries_admission_and_the_long_pool_is_the_oldest() -> None:
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.models import Replica
    from controlplane.routing import current_pools

    deployment = make_deployment("chat", model=make_model("llama"), max_replicas=4,
                                 engine_args={"max_num_seqs": 32,
                                              "scheduling_policy": "priority"},
                                 admission={"long_prompt_tokens": 2048, "long_replicas": 1})
    now = timezone.now()
    for name, age in (("chat-9", 300), ("chat-10", 10), ("chat-11", 60)):
        Replica.objects.create(deployment=deployment, name=name, phase="ready",
                               role="active", endpoint=f"http://127.0.0.1:9/{name}",
                               ready_at=now - timedelta(seconds=age))
    [pool] = current_pools()
    assert pool.long_replicas == ("chat-9",)  # ready the longest, not first by name
    assert pool.replica_concurrency == 32 and pool.priority_scheduling
    assert sorted(r.name for r in pool.context_pools()["short"]) == ["chat-10", "chat-11"]
    assert pool.context_pool_for(4000) == "long" and pool.context_pool_for(100) == "short"


def test_the_admin_site_shows_keys_and_teams_but_changes_go_through_the_audited_paths(
        ) -> None:
    from serving.services import create_api_key, create_team

    create_team("search")
    record, _ = create_api_key("crawler", "inference", team="search")
    client = Client()
    client.force_login(User.objects.create_superuser("su", password="pw-12345678"))
    listing = client.get("/admin/serving/apikey/")
    assert listing.status_code == 200 and "crawler" in listing.content.decode()
    assert client.get("/admin/serving/team/").status_code == 200
    assert client.get("/admin/serving/apikey/add/").status_code == 403
    changed = client.post(f"/admin/serving/apikey/{record.pk}/change/", {"name": "x"})
    assert changed.status_code == 403
    assert ApiKey.objects.get(pk=record.pk).name == "crawler"
    assert page_as("operator").get("/admin/").status_code == 302  # not staff: log in
