"""tests/pages.py's screenshot helper: a capture Chromium refuses for a moment is tried
again on the next frames; any other error, or a refusal on every try, fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Error

from tests.pages import CAPTURE_TRIES, TRANSIENT_CAPTURE, keep_screenshot


class Page:
    """Stands in for a Playwright page: refuses the first `refusals` captures with
    `message`, then writes a picture."""

    def __init__(self, refusals: int, message: str = TRANSIENT_CAPTURE) -> None:
        self.refusals = refusals
        self.message = message
        self.captures = 0
        self.frames_waited = 0

    def screenshot(self, path: str, full_page: bool) -> None:
        assert full_page
        self.captures += 1
        if self.captures <= self.refusals:
            raise Error(f"Page.screenshot: Protocol error (Page.captureScreenshot): "
                        f"{self.message}")
        Path(path).write_bytes(b"\x89PNG picture")

    def evaluate(self, script: str) -> None:
        assert "requestAnimationFrame" in script
        self.frames_waited += 1


def test_a_refused_capture_is_tried_again_on_the_next_frames(tmp_path: Path) -> None:
    page = Page(refusals=CAPTURE_TRIES - 1)
    keep_screenshot(page, tmp_path / "shot.png")
    assert page.captures == CAPTURE_TRIES
    assert page.frames_waited == CAPTURE_TRIES - 1
    assert (tmp_path / "shot.png").read_bytes() == b"\x89PNG picture"


def test_a_capture_refused_on_every_try_fails(tmp_path: Path) -> None:
    page = Page(refusals=CAPTURE_TRIES)
    with pytest.raises(Error, match=TRANSIENT_CAPTURE):
        keep_screenshot(page, tmp_path / "shot.png")
    assert page.captures == CAPTURE_TRIES
    assert not (tmp_path / "shot.png").exists()


def test_any_other_error_fails_at_once(tmp_path: Path) -> None:
    page = Page(refusals=1, message="Target page, context or browser has been closed")
    with pytest.raises(Error, match="has been closed"):
        keep_screenshot(page, tmp_path / "shot.png")
    assert page.captures == 1
