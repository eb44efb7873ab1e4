"""The gateway's Prometheus metrics (served at /metrics). Labels stay low-cardinality:
model, deployment, status code; never a request id or a key.

Each gauge names how workers of `manage.py serve --workers N` add up (prometheus_client's
multiprocess mode, ignored in one process): `livesum`, the sum over live workers;
`livemax` for the queue's estimated wait."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)

REQUESTS = Counter("fleetplane_gateway_requests_total", "Requests answered by the gateway",
                   ["model", "deployment", "status"])
IN_FLIGHT = Gauge("fleetplane_gateway_in_flight_requests",
                  "Requests being relayed to a replica", ["model", "deployment"],
                  multiprocess_mode="livesum")
TTFT = Histogram("fleetplane_gateway_time_to_first_token_seconds",
                 "From the request's arrival to the first byte of the answer", ["model"],
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("fleetplane_gateway_inter_token_latency_seconds",
                "Between streamed chunks", ["model"], buckets=LATENCY_BUCKETS)
E2E = Histogram("fleetplane_gateway_request_duration_seconds",
                "From the request's arrival to the end of the answer", ["model"],
                buckets=LATENCY_BUCKETS)
TOKENS = Counter("fleetplane_gateway_tokens_total", "Tokens, as reported by the engine",
                 ["model", "kind"])
RETRIES = Counter("fleetplane_gateway_retries_total",
                  "Requests retried on another replica before their first byte", ["model"])
UPSTREAM_ERRORS = Counter("fleetplane_gateway_upstream_errors_total",
                          "Failed connections or broken streams to replicas",
                          ["model", "deployment"])
QUEUED = Gauge("fleetplane_gateway_queued_requests",
               "Requests waiting in the gateway's priority queue",
               ["deployment", "priority"], multiprocess_mode="livesum")
QUEUE_ESTIMATE = Gauge("fleetplane_gateway_queue_estimated_wait_seconds",
                       "For a request joining the end of the deployment's queue now, the "
                       "wait estimated from the measured service rate", ["deployment"],
                       multiprocess_mode="livemax")
QUEUE_WAIT = Histogram("fleetplane_gateway_queue_wait_seconds",
                       "Time waited in the priority queue before a replica took the request",
                       ["deployment", "priority"], buckets=LATENCY_BUCKETS)
# The wake signal for native scaling (KEDA's activation trigger, docs/autoscaling.md):
# requests this process holds for a deployment with no ready replica.
COLD_START_WAITING = Gauge("fleetplane_gateway_cold_start_waiting_requests",
                           "Requests held at the gateway for a deployment with no ready "
                           "replica, waiting for one to come up", ["deployment"],
                           multiprocess_mode="livesum")
REFUSED = Counter("fleetplane_gateway_refused_total",
                  "Requests refused before reaching a replica, by reason",
                  ["deployment", "reason"])

USAGE_BUFFERED = Gauge("fleetplane_gateway_usage_records_buffered",
                       "Usage records waiting to be written to the database (more while it "
                       "is out of reach; at most 100,000 per event loop)",
                       multiprocess_mode="livesum")
# Read when /metrics is scraped (serving/metrics_endpoint.py): a count of the serving
# loop's tasks, so a soak can see tasks that are never finished (bench/soak.py). With
# several workers each one's last count is shown with its pid.
ASYNCIO_TASKS = Gauge("fleetplane_process_asyncio_tasks",
                      "Tasks alive on this process's serving event loop, counted when "
                      "/metrics is read", multiprocess_mode="liveall")

USAGE_DROPPED = Counter("fleetplane_gateway_usage_records_dropped_total",
                        "Usage records the database refused even written one by one, or "
                        "dropped, the oldest first, from a buffer full while the database "
                        "was out of reach (each is logged with its content)")


@functools.lru_cache(maxsize=8192)
def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once: the hot path skips the client's lock and
    label checks on every request."""
    return metric.labels(*labels)
