"""Backends share one HTTP client (controlplane/backends/vllm_http.py): one TLS context
for the process, however many external endpoints it watches."""

from __future__ import annotations

import pytest

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
    assert first.http is second.http is local.http  # type: ignore[union-attr]


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
