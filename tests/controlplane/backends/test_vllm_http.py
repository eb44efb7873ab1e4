"""Backends share one HTTP client (controlplane/backends/vllm_http.py), and external endpoints
one probe client (probe_client.py): one TLS context
for the process, however many external endpoints it watches."""

from __future__ import annotations

import pytest

from controlplane.backends import vllm_http
from controlplane.backends.base import backend_for
from controlplane.backends.external import ExternalBackend
from tests.factories import make_backend

pytestmark = pytest.mark.django_db


def test_external_backends_share_one_client_whatever_their_endpoints() -> None:
    first = backend_for(make_backend("edge-a", "external",
                                     {"url": "https://a.example.test/v1"}))
    second = backend_for(make_backend("edge-b", "external",
                                      {"url": "http://b.example.test", "api_key": "k"}))
    local = backend_for(make_backend("local", "local", {}))
    assert isinstance(first, ExternalBackend) and isinstance(second, ExternalBackend)
    assert first is not second
    # Local backends share one httpx client; external ones hold none of their own: their
    # probes all go through the process's one probe client (one pool, one TLS context).
    assert not hasattr(first, "http") and not hasattr(second, "http")
    assert local.http is vllm_http.shared_client()  # type: ignore[union-attr]
    from controlplane.backends import probe_client

    assert probe_client.shared() is probe_client.shared()


def test_many_external_backends_are_made_quickly() -> None:
    """A client each built a TLS context each (about 25 ms): a new process's first pass
    over a thousand endpoints waited for them."""
    import time

    records = [make_backend(f"edge-{i}", "external", {"url": f"https://e{i}.example.test"})
               for i in range(200)]
    started = time.perf_counter()
    for record in records:
        backend_for(record)
    assert time.perf_counter() - started < 1.0  # a client each: 10 s here


def test_the_probe_client_says_how_an_endpoint_failed() -> None:
    """Answered (any status), refused, or silent past the timeout: each told apart, and
    answers on a kept connection again and again."""
    import socket
    import time

    from controlplane.backends.probe_client import ProbeFailed, shared
    from tests.endpoints import stand_in_endpoint
    from tests.processes import free_port

    client = shared()
    with stand_in_endpoint() as endpoint:
        assert [client.status(endpoint.url, "/v1/models") for _ in range(5)] == [200] * 5
        endpoint.healthy = False
        assert client.status(endpoint.url, "/v1/models") == 503
    with pytest.raises(ProbeFailed) as refused:
        client.status(f"http://127.0.0.1:{free_port()}", "/v1/models")
    assert refused.value.kind == "ConnectError"
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        started = time.monotonic()
        with pytest.raises(ProbeFailed) as timed_out:
            client.status(f"http://127.0.0.1:{silent.getsockname()[1]}", "/v1/models",
                          timeout=0.5)
        assert timed_out.value.kind == "Timeout"
        assert 0.4 < time.monotonic() - started < 2.0
    finally:
        silent.close()
