"""Passes in proportion to what changed (controlplane/reconciler/schedule.py, probes.py):
a settled fleet costs one query a pass and no probe, a change made elsewhere is seen at
the next pass, an endpoint that keeps failing is probed on a backoff and routed to again
soon after it answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.models import Deployment, Replica
from controlplane.reconciler import Reconciler
from controlplane.routing import current_pools
from controlplane.services import set_deployment_state
from serving.sqlite_commits import commits, counter
from tests.endpoints import StandInEndpoint, stand_in_endpoint
from tests.factories import make_backend, make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def untold(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests change the database on their own connection, inside the test's
    transaction: nothing is committed, so the SQLite file's commit counter cannot see it
    (serving/sqlite_commits.py: tested there and in test_controllers.py). The passes here
    run as where the database cannot tell (PostgreSQL): the change watch queries."""
    monkeypatch.setattr(commits, "unchanged_since", lambda looked: False)


@pytest.fixture
def endpoint() -> Iterator[StandInEndpoint]:
    with stand_in_endpoint() as running:
        yield running


@pytest.fixture
def fleet(endpoint: StandInEndpoint, settings: Any) -> list[Deployment]:
    """Ten external deployments, each its own backend on the same stand-in endpoint."""
    settings.RECONCILE_RESYNC_SECONDS = 3600  # the passes between full ones are tested
    return [make_deployment(f"edge-{i}", replicas=1, backend=make_backend(
        f"edge-{i}", "external", {"url": endpoint.url})) for i in range(10)]


def settle(reconciler: Reconciler, check: Callable[[], bool], what: str,
           seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while True:
        reconciler.reconcile_changed()
        if check():
            return
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.02)


def told_unreachable(name: str, endpoint: StandInEndpoint) -> Reconciler:
    """One external deployment on the endpoint, failing, passed over until its replica is
    told unreachable; the reconciler that did it."""
    endpoint.healthy = False
    make_deployment(name, replicas=1, backend=make_backend(
        name, "external", {"url": endpoint.url}))
    reconciler = Reconciler()
    settle(reconciler, lambda: Replica.objects.exclude(last_error="").exists(),
           "told unreachable")
    return reconciler


def all_ready() -> bool:
    return Replica.objects.filter(phase=Replica.Phase.READY).count() == 10


@pytest.mark.parametrize("told", [False, pytest.param(True, marks=pytest.mark.sqlite_file)],
                         ids=["untold", "sqlite-file"])
def test_a_pass_over_a_settled_fleet_reads_one_query_writes_nothing_and_probes_nothing(
        fleet: list[Deployment], endpoint: StandInEndpoint, settings: Any,
        monkeypatch: pytest.MonkeyPatch, told: bool) -> None:
    if told:
        assert counter() is not None, "the test database is not a SQLite file"
        monkeypatch.undo()  # the file's counter itself: nothing is committed here
    settings.HEALTH_CHECK_SECONDS = 3600  # no probe falls due during the test
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    reconciler.reconcile_changed()  # the events of getting there, seen once
    probes = endpoint.requests
    with CaptureQueriesContext(connection) as queries:
        results = [reconciler.reconcile_changed() for _ in range(5)]
    assert [(r.full, r.deployments, r.changed) for r in results] == [(False, 0, 0)] * 5
    # Only the change watch's look at the audit log, once a pass; none where the
    # database file says nothing was committed since its last look.
    assert len(queries.captured_queries) == (0 if told else 5)
    assert all(q["sql"].startswith("SELECT") for q in queries.captured_queries)
    assert endpoint.requests == probes


def test_a_change_made_elsewhere_is_acted_on_at_the_next_pass(
        fleet: list[Deployment], settings: Any) -> None:
    settings.HEALTH_CHECK_SECONDS = 3600
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    reconciler.reconcile_changed()
    # As another process would: the change and its event committed, no wake-up here
    # (pytest-django runs no on_commit callback outside transaction tests).
    set_deployment_state(fleet[3], Deployment.State.STOPPED, actor="someone")
    result = reconciler.reconcile_changed()
    assert result.full and result.deployments == 10
    assert not Replica.objects.filter(deployment=fleet[3]).exists()
    assert [p.replicas for p in current_pools() if p.deployment == "edge-3"] == [()]


def test_a_pass_asked_for_visits_every_deployment(fleet: list[Deployment],
                                                  settings: Any) -> None:
    settings.HEALTH_CHECK_SECONDS = 3600
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    reconciler.reconcile_changed()
    assert reconciler.reconcile_changed().deployments == 0
    assert reconciler.reconcile_changed(requested=True).deployments == 10


def test_a_ready_endpoint_is_probed_at_its_interval_by_the_passes_between(
        fleet: list[Deployment], endpoint: StandInEndpoint, settings: Any) -> None:
    settings.HEALTH_CHECK_SECONDS = 0.2
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    probes = endpoint.requests
    settle(reconciler, lambda: endpoint.requests >= probes + 20, "two rounds of probes")
    endpoint.healthy = False
    settings.HEALTH_FAILURE_SECONDS = 0  # out of routing at the first failed probe
    settle(reconciler, lambda: not any(p.replicas for p in current_pools()),
           "every endpoint out of routing")


def test_an_endpoint_that_keeps_failing_is_probed_on_a_backoff_and_routed_again_soon(
        endpoint: StandInEndpoint, settings: Any) -> None:
    settings.RECONCILE_RESYNC_SECONDS = 3600
    settings.HEALTH_CHECK_SECONDS = 0.1
    settings.HEALTH_BACKOFF_MAX_SECONDS = 0.8
    reconciler = told_unreachable("flaky", endpoint)
    probes, started = endpoint.requests, time.monotonic()
    while time.monotonic() - started < 3.0:  # 3 s of passes, one every 20 ms
        reconciler.reconcile_changed()
        time.sleep(0.02)
    # Every 0.1 s would be 30 probes; the backoff (0.1, 0.2, 0.4, 0.8, 0.8 ...) makes
    # 6 or 7 of them.
    assert 3 <= endpoint.requests - probes <= 9
    endpoint.healthy = True
    answered = time.monotonic()
    settle(reconciler, lambda: bool([p for p in current_pools()
                                     if p.deployment == "flaky" and p.replicas]),
           "routed to again")
    assert time.monotonic() - answered < 0.8 + 1.0  # the backoff's cap, and a pass or two


def test_probes_of_a_settled_fleet_read_no_deployment(
        fleet: list[Deployment], endpoint: StandInEndpoint, settings: Any) -> None:
    """A probe that finds an endpoint as it was changes nothing: the deployment is not
    read again, and its answer is recorded in one write for the pass."""
    settings.HEALTH_CHECK_SECONDS = 0.2
    settings.HEALTH_RECORD_SECONDS = 1
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    reconciler.reconcile_changed()
    probes = endpoint.requests
    with CaptureQueriesContext(connection) as queries:
        # The ten deployments share one endpoint (URL and key): one probe a round.
        settle(reconciler, lambda: endpoint.requests >= probes + 8, "eight rounds of probes")
    tables = " ".join(q["sql"] for q in queries.captured_queries)
    assert "controlplane_deployment" not in tables
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert writes and all("last_health_at" in w for w in writes)


def test_a_new_process_takes_up_the_backoff_of_an_endpoint_long_dead(
        endpoint: StandInEndpoint, settings: Any) -> None:
    """A restarted control plane probes an endpoint that has not answered for ten minutes
    about once a backoff's bound, not every HEALTH_CHECK_SECONDS while its own count of
    failures builds up again; one that failed a moment ago is probed again soon."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.reconciler.probes import ProbePacer, inherited_failures

    settings.HEALTH_CHECK_SECONDS = 5
    settings.HEALTH_BACKOFF_MAX_SECONDS = 60
    told_unreachable("long-dead", endpoint)
    replica = Replica.objects.get()
    assert replica.last_health_at is None
    # Fresh from the first failures: the backoff starts low.
    assert ProbePacer().interval(replica, creates_replicas=False) <= 10
    Replica.objects.filter(pk=replica.pk).update(
        started_at=timezone.now() - timedelta(minutes=10))
    replica.refresh_from_db()
    assert inherited_failures(replica) == 1 + 6  # 600 s / 5 s: log2(121)
    pacer = ProbePacer()
    assert pacer.interval(replica, creates_replicas=False) == 60
    # Its first probe is due somewhere in the next minute, not at once.
    assert time.monotonic() < pacer.next_at(replica, False) <= time.monotonic() + 60
    # It answered a minute ago: the backoff a minute of failures brings (5, 10, 20, 40).
    Replica.objects.filter(pk=replica.pk).update(
        last_health_at=timezone.now() - timedelta(minutes=1))
    replica.refresh_from_db()
    assert ProbePacer().interval(replica, creates_replicas=False) == 40

    # A process that restarts (a new pacer) sends far fewer probes over 3 s of passes.
    settings.HEALTH_CHECK_SECONDS = 0.1
    settings.HEALTH_BACKOFF_MAX_SECONDS = 2.0
    Replica.objects.filter(pk=replica.pk).update(
        last_health_at=None, started_at=timezone.now() - timedelta(minutes=10))
    restarted = Reconciler()
    probes, started = endpoint.requests, time.monotonic()
    while time.monotonic() - started < 3.0:
        restarted.reconcile_changed()
        time.sleep(0.02)
    # From scratch: 0.1, 0.2, 0.4, 0.8, 1.6, 2.0 ... would be 6 probes; inherited: at
    # most two (once somewhere in the first 2 s, then 2 s later).
    assert endpoint.requests - probes <= 2


def test_endpoints_that_hang_hold_up_neither_the_passes_nor_the_endpoints_that_answer(
        endpoint: StandInEndpoint, settings: Any) -> None:
    """Forty endpoints accept connections and never answer (each probe waits out its 5 s
    timeout; more of them than the probe threads): a pass still ends within about a
    second, the one endpoint that answers is routed to at once, and the hung ones are told
    unreachable once their probes run out."""
    import socket

    from controlplane.reconciler.probes import PROBE_WAIT_SECONDS

    settings.RECONCILE_RESYNC_SECONDS = 3600
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(128)  # the kernel completes each connection; nobody reads or answers
    try:
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        for i in range(40):
            make_deployment(f"hung-{i}", replicas=1, backend=make_backend(
                f"hung-{i}", "external", {"url": hung_url}))
        make_deployment("answers", replicas=1, backend=make_backend(
            "answers", "external", {"url": endpoint.url}))
        reconciler = Reconciler()
        started = time.monotonic()
        longest = 0.0

        def timed_pass() -> None:
            nonlocal longest
            began = time.monotonic()
            reconciler.reconcile_changed()
            longest = max(longest, time.monotonic() - began)

        def routed() -> bool:
            return any(p.deployment == "answers" and p.replicas for p in current_pools())

        while not routed():
            timed_pass()
            assert time.monotonic() - started < 4, "the answering endpoint waited"
            time.sleep(0.02)
        told = Replica.objects.filter(deployment__name__startswith="hung-").exclude(
            last_error="")
        while told.count() < 40:
            timed_pass()
            assert time.monotonic() - started < 30, f"{told.count()} of 40 told unreachable"
            time.sleep(0.05)
        assert longest < PROBE_WAIT_SECONDS + 1.0
    finally:
        hung.close()


def test_hung_endpoints_past_the_probe_threads_are_each_probed_once_while_they_wait(
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty endpoints of their own that accept and never answer, more than the probe
    threads: a probe waiting for a thread is never begun again beside itself (each
    endpoint sees one connection), and every one is told unreachable once its probe
    runs out."""
    import selectors
    import socket
    import threading

    from controlplane.reconciler import probes

    monkeypatch.setattr(probes, "STALE_PROBE_SECONDS", 1.0)  # shorter than a thread's wait
    settings.RECONCILE_RESYNC_SECONDS = 3600
    settings.HEALTH_CHECK_SECONDS = 3600  # first probes only, within the test
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(40)]
    accepted: dict[int, int] = {listener.fileno(): 0 for listener in listeners}
    held: list[socket.socket] = []
    selector = selectors.DefaultSelector()
    for listener in listeners:
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ)
    done = threading.Event()

    def accept() -> None:  # counts each connection and holds it open, answering nothing
        while not done.is_set():
            for key, _ in selector.select(0.05):
                connection, _ = key.fileobj.accept()  # type: ignore[union-attr]
                held.append(connection)
                accepted[key.fd] += 1

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        for i, listener in enumerate(listeners):
            make_deployment(f"mute-{i}", replicas=1, backend=make_backend(
                f"mute-{i}", "external",
                {"url": f"http://127.0.0.1:{listener.getsockname()[1]}"}))
        reconciler = Reconciler()
        told = Replica.objects.exclude(last_error="")
        settle(reconciler, lambda: told.count() == 40, "every endpoint told unreachable",
               seconds=30)
        assert sorted(accepted.values()) == [1] * 40
    finally:
        done.set()
        thread.join(5)
        for connection in held:
            connection.close()
        for listener in listeners:
            listener.close()


def test_a_settled_fleet_is_quiet_until_a_probe_falls_due(
        fleet: list[Deployment], settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commits, "unchanged_since", lambda looked: True)  # none elsewhere
    settings.HEALTH_CHECK_SECONDS = 0.5
    reconciler = Reconciler()
    settle(reconciler, all_ready, "every replica ready")
    # The controllers skip a pass while this holds (controlplane/controllers.py).
    settle(reconciler, reconciler.schedule.quiet, "quiet")
    deadline = time.monotonic() + 5
    while reconciler.schedule.quiet():
        assert time.monotonic() < deadline, "a probe never fell due"
        time.sleep(0.02)
    assert reconciler.schedule.due()
    assert reconciler.reconcile_changed().full is False


@pytest.mark.sqlite_file
@pytest.mark.django_db(transaction=True)  # commits, as other processes see them
def test_on_sqlite_the_resync_comes_only_after_a_write_by_someone_else(
        endpoint: StandInEndpoint, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write nothing told (a SQL shell's: no event) still moves the database file's
    commit counter: the resync's full pass follows it at the next pass once due, and
    with no such write it is not needed."""
    import sqlite3

    monkeypatch.undo()  # the file's counter itself
    assert counter() is not None, "the test database is not a SQLite file"
    settings.RECONCILE_RESYNC_SECONDS = 1
    settings.HEALTH_CHECK_SECONDS = 3600
    edge = make_deployment("edge", replicas=1, backend=make_backend(
        "edge", "external", {"url": endpoint.url}))
    reconciler = Reconciler()
    settle(reconciler, lambda: Replica.objects.filter(phase=Replica.Phase.READY).exists(),
           "ready")
    schedule = reconciler.schedule
    # The passes that got there wrote (a query saw it): one resync follows them.
    settle(reconciler, lambda: schedule.quiet() and not schedule.watch.foreign,
           "quiet, a resync after the last write", seconds=15)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # past the next resync's time: still quiet
        assert schedule.quiet()
        assert reconciler.reconcile_changed().full is False
        time.sleep(0.05)
    database = connection.settings_dict["NAME"]
    with sqlite3.connect(database) as shell:  # as a SQL shell would: no event
        shell.execute(f"UPDATE {Deployment._meta.db_table} SET state = ? WHERE id = ?",
                      (Deployment.State.STOPPED.value, edge.pk))
    assert not schedule.quiet()
    assert reconciler.reconcile_changed().full is True
    assert not Replica.objects.filter(deployment=edge).exists()  # acted on
