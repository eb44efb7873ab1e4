"""What the reconcilers write: the backoff after a failure."""

from __future__ import annotations

from controlplane.reconciler import restart_backoff


def test_restart_backoff_doubles_up_to_its_cap(settings: object) -> None:
    settings.RESTART_BACKOFF_BASE_SECONDS = 5  # type: ignore[attr-defined]
    settings.RESTART_BACKOFF_MAX_SECONDS = 60  # type: ignore[attr-defined]
    delays = [restart_backoff(n).total_seconds() for n in range(1, 7)]
    assert delays == [5, 10, 20, 40, 60, 60]
