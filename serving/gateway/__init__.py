"""The data plane's front door (`/v1/*`), one module per stage:

- app.py        the ASGI application and its dispatch by path; `Gateway`, whose
                `session(call)` is the one way into the data plane (serving/session.py)
- resources.py  what requests share, built once per event loop: connection pools, the
                usage writer, the priority queue, the rate limiter, the Redis client,
                the loop's background tasks
- call.py       `Call`: everything known about one request, built once (`build_call`
                for an HTTP request) and handed to every stage
- guard.py      the caller's key, failed attempts, body size, requests in flight, rates
- placement.py  cold start, the priority queue's slot, the replica, retries
- relay.py      the answer relayed to the HTTP client (SSE or whole)
- accounting.py metrics, the usage record, the tokens owed
- watcher.py    the per-loop load watcher (replica load, route table and keys in Redis,
                revoked keys' streams)
"""

from __future__ import annotations

from serving.gateway.app import Gateway
from serving.gateway.call import Call, Timing

__all__ = ["Call", "Gateway", "Timing", "gateway"]

gateway = Gateway()
