"""Importing models for real: the demo GGUF converted into safetensors, and imports that
fail midway leaving the model failed with nothing half-written."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from models_registry import services
from models_registry.models import Model
from tests.factories import make_model, write_gguf

pytestmark = pytest.mark.django_db


def gguf_spec(name: str, path: Path) -> services.ModelSpec:
    return services.ModelSpec(name=name, source=Model.Source.GGUF, uri=str(path))


@pytest.mark.slow
def test_the_demo_gguf_becomes_a_ready_safetensors_folder(demo_gguf: Path,
                                                          models_dir: Path) -> None:
    model = services.register_model(gguf_spec("smollm2", demo_gguf),
                                    import_in_background=False)
    assert model.status == Model.Status.READY, model.error
    folder = Path(model.path)
    assert folder == models_dir / "smollm2"
    assert (folder / "model.safetensors").is_file()
    assert (folder / "config.json").is_file()
    assert model.architecture == "LlamaForCausalLM"
    assert model.parameter_count == 134_515_008
    assert model.has_chat_template
    assert model.kv_bytes_per_token() == 23_040
    assert model.license == "apache-2.0"
    assert [p.name for p in models_dir.iterdir()] == ["smollm2"]


@pytest.mark.slow
def test_the_converted_demo_model_answers_greedily_as_the_gguf_file_does(
        demo_gguf: Path) -> None:
    """The conversion keeps the weights: the same greedy tokens as the GGUF file itself,
    loaded by transformers. Not an answer the model is expected to know: greedy output
    depends on the CPU's numerics."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = services.register_model(gguf_spec("smollm2", demo_gguf),
                                    import_in_background=False)
    tokenizer: Any = AutoTokenizer.from_pretrained(model.path)
    converted: Any = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.bfloat16)
    # Dequantized to float32, then cast, as the importer does.
    original: Any = AutoModelForCausalLM.from_pretrained(
        demo_gguf.parent, gguf_file=demo_gguf.name, dtype=torch.float32)
    original = original.to(torch.bfloat16)
    inputs: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ours = converted.generate(**inputs, max_new_tokens=12, do_sample=False)
    theirs = original.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert ours[0].tolist() == theirs[0].tolist()
    assert len(ours[0]) > inputs["input_ids"].shape[1]  # it did answer


@pytest.mark.slow
def test_an_import_failing_while_writing_leaves_the_model_failed_and_no_folder(
    demo_gguf: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import PreTrainedTokenizerBase

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    # The weights are written for real; the tokenizer write then fails.
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    model = services.register_model(gguf_spec("smollm2", demo_gguf),
                                    import_in_background=False)
    assert model.status == Model.Status.FAILED
    assert "No space left on device" in model.error
    assert list(models_dir.iterdir()) == []


def test_a_gguf_that_transformers_cannot_load_fails_with_the_reason(tmp_path: Path,
                                                                    models_dir: Path) -> None:
    # A complete GGUF file with no tokenizer: valid to register, impossible to convert.
    model = services.register_model(gguf_spec("tiny", write_gguf(tmp_path / "tiny.gguf")),
                                    import_in_background=False)
    assert model.status == Model.Status.FAILED
    assert model.error.startswith("import failed:")
    assert list(models_dir.iterdir()) == []


@pytest.mark.django_db(transaction=True)
def test_an_import_through_the_api_runs_in_the_background_and_reports_failure(
    admin_client: APIClient, tmp_path: Path, models_dir: Path
) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf")
    response = admin_client.post("/api/v1/models/", {"name": "tiny", "source": "gguf",
                                                     "path": str(gguf)}, format="json")
    assert response.status_code == 202
    assert response.json()["status"] == "importing"
    deadline = time.monotonic() + 60
    status = "importing"
    while status == "importing" and time.monotonic() < deadline:
        time.sleep(0.2)
        status = admin_client.get("/api/v1/models/tiny/").json()["status"]
    body = admin_client.get("/api/v1/models/tiny/").json()
    assert body["status"] == "failed"
    assert body["error"].startswith("import failed:")
    assert list(models_dir.iterdir()) == []


def test_a_restart_marks_interrupted_imports_failed_and_removes_their_folders(
    models_dir: Path,
) -> None:
    make_model("halfway", status=Model.Status.IMPORTING, path="")
    leftover = models_dir / f"{services.IMPORTING_PREFIX}halfway-abc"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert services.recover_interrupted_imports() == 1
    model = Model.objects.get(name="halfway")
    assert model.status == Model.Status.FAILED
    assert "interrupted by a restart" in model.error
    assert not leftover.exists()


def test_deleting_an_imported_model_removes_its_folder(models_dir: Path) -> None:
    folder = models_dir / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    model = make_model("mine", source=Model.Source.GGUF, path=str(folder))
    with pytest.MonkeyPatch.context():
        from django.test import TestCase
        with TestCase.captureOnCommitCallbacks(execute=True):
            services.delete_model(model)
    assert not folder.exists()


def test_deleting_a_registered_local_folder_keeps_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir()
    model = make_model("theirs", source=Model.Source.LOCAL, path=str(folder))
    from django.test import TestCase
    with TestCase.captureOnCommitCallbacks(execute=True):
        services.delete_model(model)
    assert folder.is_dir()
