from __future__ import annotations

from pathlib import Path

import pytest

from models_registry.importers import (
    ModelSourceError,
    inspect_gguf,
    inspect_hf_folder,
    inspect_hf_id,
)
from tests.factories import tiny_llama_config, truncate_copy, write_gguf, write_hf_folder


def test_a_local_folder_yields_its_shape_and_parameter_count(tmp_path: Path) -> None:
    facts = inspect_hf_folder(write_hf_folder(tmp_path / "tiny"))
    assert facts.architecture == "LlamaForCausalLM"
    assert (facts.num_layers, facts.num_kv_heads, facts.head_size) == (2, 2, 16)
    assert facts.context_length == 512
    assert facts.parameter_count == 32 * 64 + 64 * 64
    assert facts.has_chat_template
    assert facts.size_bytes and facts.size_bytes > 0


def test_head_dim_in_the_config_wins_over_hidden_size_over_heads(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "m", tiny_llama_config(head_dim=128))
    assert inspect_hf_folder(folder).head_size == 128


def test_a_config_that_is_not_json_is_refused_naming_the_path_field(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "m", config_text="{not json")
    with pytest.raises(ModelSourceError) as error:
        inspect_hf_folder(folder)
    assert error.value.field == "path"
    assert "not valid JSON" in error.value.message


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        inspect_hf_folder(tmp_path / "nowhere")


def test_a_complete_gguf_file_is_read(tmp_path: Path) -> None:
    metadata = inspect_gguf(write_gguf(tmp_path / "tiny.gguf"))
    assert metadata["general.architecture"] == "llama"
    assert metadata["tensor_count"] == 1


def test_a_truncated_gguf_file_is_refused(tmp_path: Path, demo_gguf: Path) -> None:
    truncated = truncate_copy(demo_gguf, tmp_path / "half.gguf", 0.5)
    with pytest.raises(ModelSourceError) as error:
        inspect_gguf(truncated)
    assert error.value.field == "path"
    assert "truncated" in error.value.message or "not a readable GGUF" in error.value.message


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "weights.gguf"
    other.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        inspect_gguf(other)


def test_a_malformed_hugging_face_id_is_refused() -> None:
    with pytest.raises(ModelSourceError) as error:
        inspect_hf_id("not an id", "", hub_access=False, endpoint="http://127.0.0.1:9",
                      timeout=1)
    assert error.value.field == "hf_id"


def test_with_hub_access_off_a_hugging_face_id_is_recorded_without_contacting_it() -> None:
    facts = inspect_hf_id("fleetplane-tests/not-in-any-cache", "", hub_access=False,
                          endpoint="http://127.0.0.1:9", timeout=1)
    assert facts.num_layers is None
    assert "hub access is off" in facts.notes[0]
