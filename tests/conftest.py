from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from models_registry.demo import demo_gguf_path
from serving.models import ApiKey
from tests.factories import make_api_key

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def models_dir(settings: object, tmp_path: Path) -> Path:
    """Every test writes imported models into its own folder."""
    path = tmp_path / "models"
    path.mkdir()
    settings.MODELS_DIR = path  # type: ignore[attr-defined]
    return path


@pytest.fixture
def admin_client(db: None) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {make_api_key(ApiKey.Scope.ADMIN)}")
    return client


@pytest.fixture
def inference_client(db: None) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {make_api_key(ApiKey.Scope.INFERENCE)}")
    return client


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo_gguf_path()


def chromium_executable() -> str:
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("Chromium is not installed: run scripts/ensure-chromium.sh")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Chromium for one test module. Not for the session: Playwright's synchronous API
    keeps an event loop marked running in this thread while it is open, and the async
    tests of later modules could not start theirs."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=chromium_executable(), headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )
        yield instance
        instance.close()


@pytest.fixture(scope="session")
def demo_model_folder(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Path:
    """The demo model converted once per test session (about 20 s)."""
    from models_registry.importers import convert_gguf

    folder = tmp_path_factory.mktemp("demo-model") / "smollm2-135m-instruct"
    convert_gguf(demo_gguf, folder, lambda percent, stage: None)
    return folder
