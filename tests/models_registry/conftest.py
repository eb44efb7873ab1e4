from __future__ import annotations

from pathlib import Path

import pytest

from models_registry.demo import DemoModelMissingError, demo_gguf_path


@pytest.fixture(autouse=True)
def import_root(settings: object, tmp_path: Path) -> Path:
    """The registry's tests write model folders into their tmp_path: it is an import root
    (MODEL_IMPORT_ROOTS), with the installed demo model's folder, unless a test says
    otherwise."""
    roots = [tmp_path]
    try:
        roots.append(demo_gguf_path().parent)
    except DemoModelMissingError:
        pass  # the tests that need it say so themselves
    settings.MODEL_IMPORT_ROOTS = roots  # type: ignore[attr-defined]
    return tmp_path
