"""A local model path is registered only from under MODEL_IMPORT_ROOTS, checked after
symlinks and `..` are resolved, and the refusal says nothing about what lies outside."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from rest_framework.test import APIClient

from models_registry.models import Model
from tests.factories import write_hf_folder

pytestmark = pytest.mark.django_db
URL = "/api/v1/models/"


@pytest.fixture
def roots(settings: Any, tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    root.mkdir()
    settings.MODEL_IMPORT_ROOTS = [root]
    return root


def register(client: APIClient, path: str | Path, source: str = "local") -> Any:
    return client.post(URL, {"name": "m", "source": source, "path": str(path)}, format="json")


def test_a_folder_under_a_root_is_registered(admin_client: APIClient, roots: Path) -> None:
    response = register(admin_client, write_hf_folder(roots / "tiny"))
    assert response.status_code == 201, response.json()
    assert Model.objects.get().path == str((roots / "tiny").resolve())


def test_a_real_model_folder_outside_the_roots_is_refused(admin_client: APIClient,
                                                          roots: Path, tmp_path: Path) -> None:
    response = register(admin_client, write_hf_folder(tmp_path / "elsewhere"))
    assert response.status_code == 400
    assert "import roots" in response.json()["path"][0]
    assert Model.objects.count() == 0


def test_an_existing_and_a_missing_file_outside_the_roots_get_the_same_answer(
        admin_client: APIClient, roots: Path) -> None:
    answers = [(register(admin_client, path, source).status_code,
                register(admin_client, path, source).json())
               for path in ("/etc/shadow", "/etc/passwd", "/nonexistent", "/nonexistent/x")
               for source in ("local", "gguf")]
    assert all(answer == answers[0] for answer in answers), answers
    assert answers[0][0] == 400
    assert "/etc" not in str(answers[0][1]) and "nonexistent" not in str(answers[0][1])


def test_dot_dot_out_of_a_root_is_refused(admin_client: APIClient, roots: Path,
                                          tmp_path: Path) -> None:
    write_hf_folder(tmp_path / "outside")
    response = register(admin_client, f"{roots}/../outside")
    assert response.status_code == 400
    assert "import roots" in response.json()["path"][0]


def test_a_symlink_in_a_root_that_leads_out_of_it_is_refused(admin_client: APIClient,
                                                             roots: Path,
                                                             tmp_path: Path) -> None:
    (roots / "link").symlink_to(write_hf_folder(tmp_path / "outside"))
    response = register(admin_client, roots / "link")
    assert response.status_code == 400
    assert "import roots" in response.json()["path"][0]
    assert Model.objects.count() == 0


def test_the_registry_page_refuses_a_path_outside_the_roots(
        admin_client: APIClient, roots: Path, django_user_model: Any) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    response = client.post("/models/", {"name": "m", "source": "local",
                                        "location": "/etc"})
    assert "import roots" in response.content.decode()
    assert Model.objects.count() == 0


def test_the_register_model_command_refuses_a_path_outside_the_roots(roots: Path) -> None:
    with pytest.raises(CommandError, match="import roots"):
        call_command("register_model", "m", "--source", "gguf", "--path", "/etc/passwd")
    assert Model.objects.count() == 0
