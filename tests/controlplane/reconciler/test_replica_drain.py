"""Draining a local replica (a FAKE engine, fakes/engine.py, started by the local backend
through fakes/vllm_cli.py's stand-in interpreter): a replica whose requests in flight
cannot be read is not taken for idle; its drain deadline still bounds the wait."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from controlplane.backends.local import LocalBackend, LocalConfig
from controlplane.models import Deployment, Replica
from controlplane.reconciler.replicas import ReplicaReconciler
from fakes.vllm_cli import stand_in_python
from tests.factories import make_backend, make_deployment, make_model
from tests.processes import end_replicas

pytestmark = pytest.mark.django_db


@pytest.fixture
def draining(tmp_path: Path, settings: Any) -> Iterator[tuple[LocalBackend, Deployment,
                                                               Replica]]:
    """A started replica, taken out of service with a drain deadline a minute away."""
    settings.DATA_DIR = tmp_path / "data"
    python = stand_in_python(tmp_path)
    settings.LOCAL_BACKEND_PYTHONS = [python]
    weights = tmp_path / "weights"
    weights.mkdir()
    backend = LocalBackend(LocalConfig.from_dict({"python": python}))
    deployment = make_deployment("chat", model=make_model("fake", path=str(weights)),
                                 backend=make_backend("fakes", "local", {"python": python}))
    replica = Replica.objects.create(deployment=deployment, name="chat-1")
    backend.start(deployment, replica)
    try:
        deadline = time.monotonic() + 30
        while not backend.observe(deployment, replica).healthy:
            assert time.monotonic() < deadline, "the replica never became healthy"
            time.sleep(0.1)
        replica.phase = Replica.Phase.DRAINING
        replica.drain_deadline = timezone.now() + timedelta(minutes=1)
        replica.save()
        yield backend, deployment, replica
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(replica.pid or 0, signal.SIGCONT)
        end_replicas(str(settings.DATA_DIR))


def test_a_replica_whose_load_cannot_be_read_drains_until_its_deadline(
        draining: tuple[LocalBackend, Deployment, Replica]) -> None:
    backend, deployment, replica = draining
    assert replica.pid
    os.kill(replica.pid, signal.SIGSTOP)  # its /metrics goes silent; the process lives
    reconciler = ReplicaReconciler()
    assert backend.in_flight(replica) is None
    assert reconciler.drain(deployment, backend, replica, timezone.now()) is False
    assert replica.stop_requested_at is None and not backend.is_gone(replica)
    # At the deadline it is stopped all the same.
    assert replica.drain_deadline is not None
    assert reconciler.drain(deployment, backend, replica, replica.drain_deadline) is True
    assert replica.stop_requested_at is not None


def test_an_idle_replica_is_stopped_at_once(
        draining: tuple[LocalBackend, Deployment, Replica]) -> None:
    backend, deployment, replica = draining
    assert backend.in_flight(replica) == 0
    assert ReplicaReconciler().drain(deployment, backend, replica, timezone.now()) is True
    assert replica.stop_requested_at is not None


def test_with_gateways_in_other_processes_an_idle_replica_waits_until_they_read_the_routes(
        draining: tuple[LocalBackend, Deployment, Replica], settings: Any) -> None:
    backend, deployment, replica = draining
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"  # gateways elsewhere read the routes
    settings.GATEWAY_LOAD_SCRAPE_SECONDS = 0.5
    reconciler = ReplicaReconciler()
    began = time.monotonic()
    assert reconciler.drain(deployment, backend, replica, timezone.now()) is False
    assert backend.in_flight(replica) == 0 and replica.stop_requested_at is None
    while not reconciler.drain(deployment, backend, replica, timezone.now()):
        assert time.monotonic() - began < 30, "the idle replica was never stopped"
        time.sleep(0.05)
    assert time.monotonic() - began >= 2 * settings.GATEWAY_LOAD_SCRAPE_SECONDS
    assert replica.stop_requested_at is not None
