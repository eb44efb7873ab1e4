"""Test data: models, API keys, and small model files written on the fly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models_registry.models import Model
from serving.models import ApiKey
from serving.services import create_api_key

# The demo model's shape (SmolLM2-135M-Instruct).
DEMO_SHAPE: dict[str, Any] = {
    "architecture": "LlamaForCausalLM", "parameter_count": 134_515_008,
    "context_length": 8192, "dtype": "bfloat16", "num_layers": 30,
    "num_attention_heads": 9, "num_kv_heads": 3, "head_size": 64,
}


def make_model(name: str = "demo", **fields: Any) -> Model:
    values: dict[str, Any] = {
        "display_name": name, "source": Model.Source.LOCAL, "source_uri": f"/models/{name}",
        "path": f"/models/{name}", "status": Model.Status.READY, **DEMO_SHAPE,
    }
    values.update(fields)
    return Model.objects.create(name=name, **values)


def make_api_key(scope: str = ApiKey.Scope.ADMIN, name: str = "tests") -> str:
    _, key = create_api_key(name, scope)
    return key


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 512,
        "vocab_size": 32, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    }
    config.update(overrides)
    return config


def write_hf_folder(folder: Path, config: dict[str, Any] | None = None,
                    config_text: str | None = None) -> Path:
    """A small Hugging Face folder: config.json, a tokenizer file, one safetensors file."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        config_text if config_text is not None else json.dumps(config or tiny_llama_config())
    )
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    )
    save_file({"embed.weight": torch.zeros(32, 64), "layer.weight": torch.zeros(64, 64)},
              str(folder / "model.safetensors"))
    return folder


def write_gguf(path: Path, architecture: str = "llama") -> Path:
    """A small, complete GGUF file with one tensor and no tokenizer."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def truncate_copy(source: Path, target: Path, fraction: float = 0.5) -> Path:
    data = source.read_bytes()
    target.write_bytes(data[: int(len(data) * fraction)])
    return target


def make_backend(name: str = "local", kind: str = "local",
                 config: dict[str, Any] | None = None) -> Any:
    from controlplane.models import Backend

    return Backend.objects.create(name=name, kind=kind, config=config or {})


def make_deployment(name: str = "demo", model: Model | None = None, backend: Any = None,
                    **fields: Any) -> Any:
    from controlplane.models import Deployment

    return Deployment.objects.create(
        name=name, model=model or make_model(f"{name}-model"),
        backend=backend or make_backend(), **fields)
