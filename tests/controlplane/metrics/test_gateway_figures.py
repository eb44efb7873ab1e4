"""The gateway's figures per deployment, from this process's registry."""

from __future__ import annotations

import time

from controlplane.metrics.gateway_figures import GatewayCounters


def test_requests_queued_at_the_gateway_are_counted_per_deployment() -> None:
    from serving import metrics

    metrics.child(metrics.QUEUED, "queued-demo", "batch").set(3)
    metrics.child(metrics.QUEUED, "queued-demo", "critical").set(1)
    metrics.child(metrics.QUEUE_ESTIMATE, "queued-demo").set(1.5)
    try:
        out = GatewayCounters().read(time.time())
        assert out["_queued"]["queued-demo"] == 4  # type: ignore[index]
        assert out["_queue_wait"]["queued-demo"] == 1.5  # type: ignore[index]
    finally:
        metrics.child(metrics.QUEUED, "queued-demo", "batch").set(0)
        metrics.child(metrics.QUEUED, "queued-demo", "critical").set(0)
