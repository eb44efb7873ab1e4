from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def import_root(settings: object, tmp_path: Path) -> Path:
    """The registry's tests write model folders into their tmp_path: it is the import root
    (MODEL_IMPORT_ROOTS) unless a test says otherwise."""
    settings.MODEL_IMPORT_ROOTS = [tmp_path]  # type: ignore[attr-defined]
    return tmp_path
