"""The registry's REST API, bad input first: each refusal names the field and leaves
nothing behind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from models_registry.models import Model
from tests.factories import make_model, truncate_copy, write_gguf, write_hf_folder

pytestmark = pytest.mark.django_db
URL = "/api/v1/models/"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_nothing_left(models_dir: Path) -> None:
    assert Model.objects.count() == 0
    assert list(models_dir.iterdir()) == []


def test_listing_needs_a_key() -> None:
    response = APIClient().get(URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_wrong_key_is_refused() -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer fp-not-a-real-key")
    assert client.get(URL).status_code == 401


def test_an_inference_key_may_not_use_the_admin_api(inference_client: APIClient) -> None:
    response = inference_client.get(URL)
    assert response.status_code == 403
    assert "admin-scope" in response.json()["detail"]


def test_the_list_shows_shape_and_kv_bytes_per_token(admin_client: APIClient) -> None:
    make_model("smollm2")
    body = admin_client.get(URL).json()
    assert body["count"] == 1
    model = body["results"][0]
    assert model["name"] == "smollm2"
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["parameter_count"] == 134_515_008
    assert model["context_length"] == 8192
    assert model["kv_bytes_per_token"] == 23_040


def test_registering_a_local_folder_makes_a_ready_model(admin_client: APIClient,
                                                        tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "tiny")
    response = admin_client.post(URL, {"name": "tiny", "source": "local", "path": str(folder)},
                                 format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["status"] == "ready"
    assert response.json()["num_layers"] == 2
    assert admin_client.get(f"{URL}tiny/").json()["path"] == str(folder.resolve())


def test_a_missing_folder_is_a_400_naming_path(admin_client: APIClient, tmp_path: Path,
                                              models_dir: Path) -> None:
    response = admin_client.post(URL, {"name": "gone", "source": "local",
                                       "path": str(tmp_path / "missing")}, format="json")
    assert response.status_code == 400
    assert "does not exist" in response.json()["path"][0]
    assert_nothing_left(models_dir)


def test_a_config_that_is_not_json_is_a_400_naming_path(admin_client: APIClient,
                                                       tmp_path: Path,
                                                       models_dir: Path) -> None:
    folder = write_hf_folder(tmp_path / "broken", config_text='{"hidden_size": ')
    response = admin_client.post(URL, {"name": "broken", "source": "local",
                                       "path": str(folder)}, format="json")
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["path"][0]
    assert_nothing_left(models_dir)


def test_a_truncated_gguf_file_is_a_400_naming_path(admin_client: APIClient, tmp_path: Path,
                                                   models_dir: Path) -> None:
    truncated = truncate_copy(write_gguf(tmp_path / "t.gguf"), tmp_path / "cut.gguf", 0.8)
    response = admin_client.post(URL, {"name": "cut", "source": "gguf",
                                       "path": str(truncated)}, format="json")
    assert response.status_code == 400
    assert "path" in response.json()
    assert_nothing_left(models_dir)


def test_a_file_that_is_not_gguf_is_a_400_naming_path(admin_client: APIClient, tmp_path: Path,
                                                     models_dir: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("just text")
    response = admin_client.post(URL, {"name": "fake", "source": "gguf", "path": str(fake)},
                                 format="json")
    assert response.status_code == 400
    assert "not a GGUF file" in response.json()["path"][0]
    assert_nothing_left(models_dir)


def test_a_duplicate_name_is_a_conflict(admin_client: APIClient, tmp_path: Path) -> None:
    make_model("taken")
    folder = write_hf_folder(tmp_path / "tiny")
    response = admin_client.post(URL, {"name": "taken", "source": "local",
                                       "path": str(folder)}, format="json")
    assert response.status_code == 409
    assert "already exists" in response.json()["detail"]
    assert Model.objects.count() == 1


@pytest.mark.parametrize("name", ["Not A Slug", "UPPER", "under_score", "dots.in.name", ""])
def test_a_name_that_is_not_a_slug_is_a_400_naming_name(admin_client: APIClient,
                                                       tmp_path: Path, models_dir: Path,
                                                       name: str) -> None:
    folder = write_hf_folder(tmp_path / "tiny")
    response = admin_client.post(URL, {"name": name, "source": "local", "path": str(folder)},
                                 format="json")
    assert response.status_code == 400
    assert "name" in response.json()
    assert_nothing_left(models_dir)


def test_a_missing_path_is_a_400_naming_path(admin_client: APIClient) -> None:
    response = admin_client.post(URL, {"name": "x", "source": "gguf"}, format="json")
    assert response.status_code == 400
    assert "path" in response.json()


def test_an_unknown_source_is_a_400_naming_source(admin_client: APIClient) -> None:
    response = admin_client.post(URL, {"name": "x", "source": "ftp", "path": "/x"},
                                 format="json")
    assert response.status_code == 400
    assert "source" in response.json()


def test_a_body_that_is_not_json_is_a_400(admin_client: APIClient) -> None:
    response = admin_client.post(URL, "{oops", content_type="application/json")
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]


def test_a_hugging_face_id_is_recorded_for_backends_that_download_it(
    admin_client: APIClient,
) -> None:
    response = admin_client.post(URL, {"name": "remote", "source": "huggingface",
                                       "hf_id": "fleetplane-tests/not-cached"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["status"] == "registered"
    assert "hub access is off" in body["error"]


def test_an_unreachable_hub_is_said_plainly(admin_client: APIClient, settings: object) -> None:
    settings.HUB_ACCESS = True  # type: ignore[attr-defined]
    settings.HF_ENDPOINT = f"http://127.0.0.1:{closed_port()}"  # type: ignore[attr-defined]
    settings.HUB_TIMEOUT_SECONDS = 2  # type: ignore[attr-defined]
    response = admin_client.post(URL, {"name": "remote", "source": "huggingface",
                                       "hf_id": "fleetplane-tests/not-cached"}, format="json")
    assert response.status_code == 201
    assert "could not reach the Hugging Face Hub" in response.json()["error"]


def test_capacity_for_the_presets_and_for_a_given_memory(admin_client: APIClient) -> None:
    make_model("smollm2")
    presets = admin_client.get(f"{URL}smollm2/capacity/").json()
    assert [row["memory_gib"] for row in presets] == [24, 80, 141]
    custom = admin_client.get(f"{URL}smollm2/capacity/", {
        "memory_gib": "16", "utilization": "0.8", "sequence_length": "4096",
        "kv_cache_dtype": "fp8"}).json()
    assert len(custom) == 1
    assert custom[0]["kv_bytes_per_token"] == 11_520
    assert custom[0]["max_concurrent_sequences"] == custom[0]["kv_cache_tokens"] // 4096


def test_capacity_refuses_a_bad_utilization_naming_it(admin_client: APIClient) -> None:
    make_model("smollm2")
    response = admin_client.get(f"{URL}smollm2/capacity/", {"utilization": 2})
    assert response.status_code == 400
    assert "utilization" in response.json()


def test_capacity_of_a_model_of_unknown_shape_is_a_409(admin_client: APIClient) -> None:
    make_model("remote", num_layers=None, status=Model.Status.REGISTERED)
    assert admin_client.get(f"{URL}remote/capacity/").status_code == 409


def test_deleting_a_model_removes_it(admin_client: APIClient) -> None:
    make_model("old")
    assert admin_client.delete(f"{URL}old/").status_code == 204
    assert admin_client.get(f"{URL}old/").status_code == 404


def test_a_model_that_is_importing_cannot_be_deleted(admin_client: APIClient) -> None:
    make_model("busy", status=Model.Status.IMPORTING)
    assert admin_client.delete(f"{URL}busy/").status_code == 409
    assert Model.objects.filter(name="busy").exists()


def test_the_openapi_schema_describes_the_models_api(admin_client: APIClient) -> None:
    response = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    assert "/api/v1/models/" in schema["paths"]
    assert "/api/v1/models/{name}/capacity/" in schema["paths"]
