"""The HTTP client every backend shares, and the two requests every backend that runs
vLLM sends to a replica: one real completion to warm it up, and a read of its queue
(running plus waiting requests) from /metrics."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import httpx

from controlplane.backends.base import BackendError

if TYPE_CHECKING:
    from controlplane.models import Deployment


_client: httpx.Client | None = None
_client_lock = threading.Lock()


def shared_client() -> httpx.Client:
    """The process's one client for local backends' probes, warm-ups and queue reads
    (external endpoints are probed through probe_client.py). Each httpx.Client builds
    its own TLS context (about 25 ms and 0.85 MiB), so a client per backend made a new
    control plane's first pass over 1,000 external endpoints take half a minute; one
    shared client builds one, and pools connections per host. Its
    requests are independent (each passes its own headers and timeout), and it is safe to
    use from the reconciler's probe threads at once."""
    global _client
    with _client_lock:
        if _client is None:
            _client = httpx.Client(limits=httpx.Limits(max_connections=256,
                                                       max_keepalive_connections=64))
        return _client


def auth(key: str) -> dict[str, str]:
    """The header every request to a replica carries: vLLM checks the key on /v1/* only,
    but it is sent everywhere, so a server that checks more still answers."""
    return {"Authorization": f"Bearer {key}"} if key else {}


# Within the controllers' stall bound (controlplane/liveness.py): one step of a pass.
WARM_UP_SECONDS = 60.0


def warm_up(http: httpx.Client, deployment: Deployment, endpoint: str) -> None:
    """One real request, so no user pays the first-request cost; raises on failure. An
    embedding model is asked for an embedding, any other for a one-token completion."""
    name = deployment.served_model_name()
    path, body = ("/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 1,
                                      "temperature": 0})
    if deployment.model.task == "embed":
        path, body = "/v1/embeddings", {"model": name, "input": "Hello"}
    try:
        response = http.post(f"{endpoint}{path}", json=body, timeout=WARM_UP_SECONDS,
                             headers=auth(deployment.upstream_key()))
    except httpx.HTTPError as exc:
        raise BackendError(f"warm-up request failed: {exc.__class__.__name__}") from None
    if response.status_code != 200:
        raise BackendError(f"warm-up request answered {response.status_code}: "
                           f"{response.text[:300]}")


def in_flight(http: httpx.Client, endpoint: str, key: str) -> int | None:
    """Requests the server is running or queueing, or None when it cannot be read."""
    from serving.engine_metrics import requests_in_system

    try:
        response = http.get(f"{endpoint}/metrics", timeout=3.0, headers=auth(key))
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    total = requests_in_system(response.text)
    return None if total is None else int(total)
