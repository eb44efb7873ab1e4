"""Helpers for the tests that drive pages in headless Chromium."""

from __future__ import annotations

from pathlib import Path

# Chromium refuses a capture now and then while the compositor swaps a frame (the live
# pages redraw their charts and tables as updates arrive): the DevTools call fails with
# this message and the next frame's capture succeeds.
TRANSIENT_CAPTURE = "Unable to capture screenshot"
CAPTURE_TRIES = 3


def keep_screenshot(page: object, path: Path) -> None:
    """Saves a full-page screenshot of `page` to `path`, trying again on the next
    animation frames when Chromium refuses a capture for a moment; any other error, or
    the same refusal on every try, is raised."""
    from playwright.sync_api import Error

    for attempt in range(1, CAPTURE_TRIES + 1):
        try:
            page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
            break
        except Error as error:
            if TRANSIENT_CAPTURE not in str(error) or attempt == CAPTURE_TRIES:
                raise
            page.evaluate(  # type: ignore[attr-defined]
                "() => new Promise(done => requestAnimationFrame("
                "() => requestAnimationFrame(done)))")
    if path.stat().st_size == 0:
        raise AssertionError(f"the screenshot {path} is empty")
