"""The gateway's figures per deployment: requests and errors per second (between two
passes and over the summary window), requests in flight, queued, and the queue's
estimated wait."""

from __future__ import annotations

from collections import deque

from controlplane.metrics.rates import SUMMARY_SECONDS, rate, rounded


class GatewayCounters:
    """This process's gateway counters, as per-deployment rates between two passes."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, float]] = {}
        self.last_at = 0.0
        self.window: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()

    def read(self, at: float) -> dict[str, dict[str, float | None]]:
        from serving import metrics

        totals: dict[str, list[float]] = {}
        in_flight: dict[str, float] = {}
        # These two families only: collecting the whole registry walks every histogram.
        queued: dict[str, float] = {}
        queue_wait: dict[str, float] = {}
        for family in (*metrics.REQUESTS.collect(), *metrics.IN_FLIGHT.collect(),
                       *metrics.QUEUED.collect(), *metrics.QUEUE_ESTIMATE.collect()):
            if family.name == "fleetplane_gateway_requests":
                for sample in family.samples:
                    if sample.name != "fleetplane_gateway_requests_total":
                        continue
                    entry = totals.setdefault(sample.labels["deployment"], [0.0, 0.0])
                    entry[0] += sample.value
                    if not sample.labels["status"].startswith("2"):
                        entry[1] += sample.value
            elif family.name == "fleetplane_gateway_in_flight_requests":
                for sample in family.samples:
                    deployment = sample.labels["deployment"]
                    in_flight[deployment] = in_flight.get(deployment, 0.0) + sample.value
            elif family.name == "fleetplane_gateway_queue_estimated_wait_seconds":
                for sample in family.samples:
                    queue_wait[sample.labels["deployment"]] = sample.value
            elif family.name == "fleetplane_gateway_queued_requests":
                for sample in family.samples:
                    deployment = sample.labels["deployment"]
                    queued[deployment] = queued.get(deployment, 0.0) + sample.value
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
        out["_in_flight"] = dict(in_flight)  # type: ignore[assignment]
        out["_queued"] = dict(queued)  # type: ignore[assignment]
        out["_queue_wait"] = dict(queue_wait)  # type: ignore[assignment]
        return out
