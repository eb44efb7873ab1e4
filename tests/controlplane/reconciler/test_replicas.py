"""The reconciler against the external backend (a stand-in endpoint on loopback): it
converges, does nothing on a pass with nothing to do, and reports what it sees."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.models import AuditEvent, Deployment, Replica
from controlplane.reconciler import Reconciler
from tests.endpoints import StandInEndpoint, stand_in_endpoint
from tests.factories import make_backend, make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint() -> Iterator[StandInEndpoint]:
    with stand_in_endpoint() as running:
        yield running


@pytest.fixture
def external(endpoint: StandInEndpoint) -> Deployment:
    backend = make_backend("edge", "external", {"url": endpoint.url})
    return make_deployment("remote", backend=backend, replicas=1)


def test_an_external_endpoint_becomes_one_ready_replica(external: Deployment,
                                                        endpoint: StandInEndpoint) -> None:
    reconciler = Reconciler()
    for _ in range(4):
        reconciler.reconcile_all()
    replica = Replica.objects.get()
    assert replica.phase == Replica.Phase.READY
    assert replica.endpoint == endpoint.url
    assert replica.pid is None
    external.refresh_from_db()
    assert external.is_ready()
    assert external.observed_generation == external.generation


def test_a_pass_with_nothing_to_change_writes_nothing(external: Deployment) -> None:
    reconciler = Reconciler()
    for _ in range(4):
        reconciler.reconcile_all()
    with CaptureQueriesContext(connection) as queries:
        result = reconciler.reconcile_all()
    assert result.changed == 0
    writes = [q["sql"] for q in queries.captured_queries
              if q["sql"].split()[0] in ("INSERT", "UPDATE", "DELETE")]
    assert writes == []


def test_an_endpoint_that_stops_answering_is_probed_not_restarted_and_comes_back(
    external: Deployment, endpoint: StandInEndpoint, settings: object
) -> None:
    """Something else runs an external endpoint: when it stops answering it leaves the
    route table with the error (after HEALTH_FAILURE_SECONDS), is probed every health
    interval (its backoff capped at that interval here; the backoff itself:
    test_schedule.py), never counted as a restart, and is routed to again within one
    interval of answering."""
    from controlplane.routing import current_pools

    settings.HEALTH_CHECK_SECONDS = 0.3  # type: ignore[attr-defined]
    settings.HEALTH_BACKOFF_MAX_SECONDS = 0.3  # type: ignore[attr-defined]
    settings.HEALTH_FAILURE_SECONDS = 1  # type: ignore[attr-defined]
    reconciler = Reconciler()
    converge(reconciler, lambda: Replica.objects.get().phase == Replica.Phase.READY, "ready")
    endpoint.healthy = False
    converge(reconciler, lambda: Replica.objects.get().phase != Replica.Phase.READY,
             "out of routing")
    replica = Replica.objects.get()
    assert replica.phase == Replica.Phase.LOADING
    assert replica.last_error == f"{endpoint.url} unreachable (/v1/models answered 503)"
    assert replica.restart_count == 0 and replica.next_restart_at is None
    assert [p.replicas for p in current_pools() if p.deployment == "remote"] == [()]
    external.refresh_from_db()
    degraded = external.condition("Degraded")
    assert degraded is not None and degraded["status"] == "True"
    [told] = AuditEvent.objects.filter(action="replica-unreachable")
    assert "not restarted" in told.message
    assert not AuditEvent.objects.filter(action__in=("replica-crashed", "replica-failed"))
    # Probed every interval, not every pass: no storm against an endpoint that is down.
    before, started = endpoint.requests, time.monotonic()
    for _ in range(10):
        reconciler.reconcile_all()
    elapsed = time.monotonic() - started
    assert endpoint.requests - before <= elapsed / 0.3 + 1
    endpoint.healthy = True
    answered = time.monotonic()
    converge(reconciler, lambda: Replica.objects.get().phase == Replica.Phase.READY,
             "routed to again")
    assert time.monotonic() - answered < 0.3 + 1.0  # one interval, and a pass or two
    replica = Replica.objects.get()
    assert replica.last_error == "" and replica.restart_count == 0
    assert [len(p.replicas) for p in current_pools() if p.deployment == "remote"] == [1]


def test_an_endpoint_that_cannot_be_reached_says_so_with_the_error(settings: object) -> None:
    from tests.processes import free_port

    settings.HEALTH_CHECK_SECONDS = 0.3  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    make_deployment("gone", backend=make_backend("nowhere", "external", {"url": url}),
                    replicas=1)
    reconciler = Reconciler()
    converge(reconciler, lambda: Replica.objects.filter().exclude(last_error="").exists(),
             "the error shown")
    replica = Replica.objects.get()
    assert replica.phase == Replica.Phase.LOADING and replica.restart_count == 0
    assert replica.last_error.startswith(f"{url} unreachable (ConnectError")


def converge(reconciler: Reconciler, check: Callable[[], bool], what: str,
             seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while True:
        reconciler.reconcile_all()
        if check():
            return
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)


def test_stopping_an_external_deployment_takes_its_replica_away(external: Deployment) -> None:
    reconciler = Reconciler()
    for _ in range(4):
        reconciler.reconcile_all()
    Deployment.objects.filter(pk=external.pk).update(state=Deployment.State.STOPPED)
    reconciler.reconcile_all()
    assert Replica.objects.count() == 0


def test_a_deleted_deployment_goes_once_its_replicas_are_gone(external: Deployment) -> None:
    reconciler = Reconciler()
    for _ in range(3):
        reconciler.reconcile_all()
    Deployment.objects.filter(pk=external.pk).update(deleting=True)
    reconciler.reconcile_all()
    reconciler.reconcile_all()
    assert not Deployment.objects.filter(pk=external.pk).exists()

