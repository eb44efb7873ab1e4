"""The gateway's figures per deployment: requests and errors per second (between two
passes and over the summary window), requests in flight, queued, and the queue's
estimated wait."""

from __future__ import annotations

from collections import deque

from django.conf import settings

from controlplane.metrics.rates import SUMMARY_SECONDS, rate, rounded


class GatewayCounters:
    """The gateway's counters, as per-deployment rates between two passes: this process's,
    and with REDIS_URL every gateway process's, summed (serving/figures.py)."""

    def __init__(self) -> None:
        from serving.figures import FleetFigures

        self.fleet = FleetFigures()
        self.last: dict[str, tuple[float, float]] = {}
        self.last_at = 0.0
        self.window: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()

    def read(self, at: float) -> dict[str, dict[str, float | None]]:
        """Request and error rates per deployment (since the last pass, and over the
        summary window), with the in-flight, queued and queue-wait figures under
        `_in_flight`, `_queued` and `_queue_wait`."""
        figures = self.fleet.read(settings.REDIS_URL or None, at)
        totals = figures.requests
        seconds = at - self.last_at
        out: dict[str, dict[str, float | None]] = {}
        for deployment, (count, errors) in totals.items():
            before = self.last.get(deployment)
            requests = rate(count, before[0] if before else None, seconds)
            failed = rate(errors, before[1] if before else None, seconds)
            out[deployment] = {
                "requests_per_s": rounded(requests, 3),
                "error_rate": rounded(failed / requests) if requests and failed is not None
                else (0.0 if requests == 0 else None)}
        self.last = {deployment: (count, errors) for deployment, (count, errors)
                     in totals.items()}
        self.last_at = at
        self.window.append((at, self.last))
        while len(self.window) > 2 and self.window[1][0] <= at - SUMMARY_SECONDS:
            self.window.popleft()
        start, oldest = self.window[0]
        for deployment, (count, errors) in self.last.items():
            before = oldest.get(deployment, (0.0, 0.0)) if start < at else None
            requests = rate(count, before[0] if before else None, at - start)
            failed = rate(errors, before[1] if before else None, at - start)
            out.setdefault(deployment, {})["window_requests_per_s"] = rounded(requests, 3)
            out[deployment]["window_error_rate"] = (
                rounded(failed / requests) if requests and failed is not None
                else (0.0 if requests == 0 else None))
        out["_in_flight"] = dict(figures.in_flight)  # type: ignore[assignment]
        out["_queued"] = dict(figures.queued)  # type: ignore[assignment]
        out["_queue_wait"] = dict(figures.queue_wait)  # type: ignore[assignment]
        return out
