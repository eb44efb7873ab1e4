from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from serving.models import ApiKey
from serving.services import hash_key, revoke_api_key

pytestmark = pytest.mark.django_db


def create_key_with_command(scope: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_key", "--name", "automation", "--scope", scope, stdout=out,
                 stderr=err)
    return out.getvalue().strip().splitlines()[-1]


def test_the_command_prints_the_key_on_its_last_line_and_stores_only_a_hash() -> None:
    key = create_key_with_command("admin")
    record = ApiKey.objects.get()
    assert key.startswith("fp-")
    assert record.key_hash == hash_key(key)
    assert key not in {record.name, record.prefix, record.key_hash}
    assert record.scope == "admin"


def test_a_key_from_the_command_opens_the_admin_api() -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {create_key_with_command('admin')}")
    assert client.get("/api/v1/models/").status_code == 200


def test_a_revoked_key_is_refused_at_once() -> None:
    key = create_key_with_command("admin")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.get("/api/v1/models/").status_code == 200
    revoke_api_key(ApiKey.objects.get())
    response = client.get("/api/v1/models/")
    assert response.status_code == 401
    assert "revoked" in response.json()["detail"]


def test_an_unknown_scope_is_refused_by_the_command() -> None:
    with pytest.raises(CommandError, match="invalid choice: 'root'"):
        call_command("create_api_key", "--name", "x", "--scope", "root",
                     stderr=io.StringIO())
    assert ApiKey.objects.count() == 0


def test_a_staff_session_may_use_the_api_too(django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("ops", password="pw-for-tests-1", is_staff=True)
    client = APIClient()
    client.force_login(user)
    assert client.get("/api/v1/models/").status_code == 200


def test_a_non_staff_session_may_not(django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("viewer", password="pw-for-tests-1")
    client = APIClient()
    client.force_login(user)
    assert client.get("/api/v1/models/").status_code == 403
