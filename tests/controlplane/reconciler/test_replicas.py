"""The reconciler against the external backend (a stand-in endpoint on loopback): it
converges, does nothing on a pass with nothing to do, and reports what it sees."""

from __future__ import annotations

from collections.abc import Iterator

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


def test_an_endpoint_that_stops_answering_fails_with_the_reason_and_backs_off(
    external: Deployment, endpoint: StandInEndpoint, settings: object
) -> None:
    settings.HEALTH_CHECK_SECONDS = 0  # type: ignore[attr-defined]
    reconciler = Reconciler()
    for _ in range(4):
        reconciler.reconcile_all()
    endpoint.healthy = False
    reconciler.reconcile_all()
    replica = Replica.objects.get()
    assert replica.phase == Replica.Phase.FAILED
    assert replica.restart_count == 1
    assert replica.next_restart_at is not None
    external.refresh_from_db()
    degraded = external.condition("Degraded")
    assert degraded is not None and degraded["status"] == "True"
    assert AuditEvent.objects.filter(action="replica-crashed").exists()
    # While backing off nothing is retried: no restart storm.
    before = endpoint.requests
    for _ in range(5):
        reconciler.reconcile_all()
    assert endpoint.requests == before
    assert Replica.objects.get().restart_count == 1


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

