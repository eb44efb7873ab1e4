"""The registry pages, rendered by Django (the browser path is in tests/controlplane)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from models_registry.models import Model
from tests.factories import make_model, write_hf_folder

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    return client


def test_pages_need_a_login() -> None:
    response = Client().get("/models/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_the_registry_links_each_model_to_its_page(staff_client: Client) -> None:
    make_model("smollm2")
    assert 'href="/models/smollm2/"' in staff_client.get("/models/").content.decode()


def test_the_model_page_shows_the_kv_bytes_and_an_estimate_per_preset(
    staff_client: Client,
) -> None:
    make_model("smollm2")
    page = staff_client.get("/models/smollm2/").content.decode()
    assert 'id="kv-per-token">23,040 bytes' in page
    assert page.count("GiB</td>") >= 3


def test_the_model_page_says_what_the_model_does(staff_client: Client) -> None:
    make_model("minilm", task=Model.Task.EMBED)
    page = staff_client.get("/models/minilm/").content.decode()
    assert '<dd id="model-task">Embeddings</dd>' in page


def test_the_model_page_estimates_for_any_memory_size(staff_client: Client) -> None:
    make_model("smollm2")
    page = staff_client.get("/models/smollm2/", {"memory_gib": "16"}).content.decode()
    assert "<td>16 GiB</td>" in page


def test_a_bad_estimate_input_is_shown_next_to_its_field(staff_client: Client) -> None:
    make_model("smollm2")
    page = staff_client.get("/models/smollm2/", {"utilization": "3"}).content.decode()
    assert "less than or equal to 1" in page


def test_registering_from_the_page_shows_the_error_next_to_the_field(
    staff_client: Client, tmp_path: Path
) -> None:
    response = staff_client.post("/models/", {"name": "x", "source": "local",
                                              "location": str(tmp_path / "nope")})
    assert response.status_code == 200
    assert "does not exist" in response.content.decode()
    assert Model.objects.count() == 0


def test_registering_from_the_page_adds_the_model(staff_client: Client,
                                                  tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "tiny")
    response = staff_client.post("/models/", {"name": "tiny", "source": "local",
                                              "location": str(folder)}, follow=True)
    assert "Model tiny registered (ready)" in response.content.decode()
    assert Model.objects.get().name == "tiny"
