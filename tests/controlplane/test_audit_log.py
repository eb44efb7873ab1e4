"""The audit log at fleet scale: repeated events are one row with a count and the time
last seen, old rows are pruned in bounded batches (security events kept longer), and the
events API never counts the whole table."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane import audit_log
from controlplane.audit_log import Cutoffs, prune_events, run_event_pruning
from controlplane.models import AuditEvent
from controlplane.services import audit
from tests.factories import make_backend, make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(db: None) -> Any:
    return make_deployment("chat", backend=make_backend("edge", "external",
                                                        {"url": "http://127.0.0.1:9"}))


def seen_ago(event: AuditEvent, **delta: float) -> None:
    """Move an event's first and last sightings into the past."""
    when = timezone.now() - timedelta(**delta)
    AuditEvent.objects.filter(pk=event.pk).update(at=when, last_seen=when)


def unreachable(deployment: Any, replica: str = "chat-r1") -> None:
    audit("reconciler", "replica-unreachable", deployment,
          f"{replica}: connection refused", replica=replica)


def test_a_repeated_event_is_one_row_with_its_count_and_last_seen(deployment: Any) -> None:
    unreachable(deployment)
    first = AuditEvent.objects.get()
    seen_ago(first, seconds=30)
    for _ in range(4):
        unreachable(deployment)
    event = AuditEvent.objects.get()
    assert event.count == 5
    assert event.last_seen > event.at
    assert timezone.now() - event.last_seen < timedelta(seconds=30)


def test_a_repeat_costs_one_indexed_update(deployment: Any,
                                           django_assert_num_queries: Any) -> None:
    unreachable(deployment)
    with CaptureQueriesContext(connection) as queries:
        unreachable(deployment)
    assert len(queries) == 1
    assert queries[0]["sql"].startswith("UPDATE")
    assert '"key"' in queries[0]["sql"]


def test_events_that_differ_are_separate_rows(deployment: Any) -> None:
    unreachable(deployment, "chat-r1")
    unreachable(deployment, "chat-r2")
    audit("reconciler", "replica-unreachable", deployment, "chat-r1: no route to host",
          replica="chat-r1")
    audit("alice", "replica-unreachable", deployment, "chat-r1: connection refused",
          replica="chat-r1")
    assert AuditEvent.objects.count() == 4
    assert set(AuditEvent.objects.values_list("count", flat=True)) == {1}


def test_numbers_in_a_message_coalesce_and_the_latest_wording_is_kept(deployment: Any) -> None:
    audit("reconciler", "replica-crashed", deployment, "chat-r1 exited\nrestart 1 in 5 s",
          replica="chat-r1")
    audit("reconciler", "replica-crashed", deployment, "chat-r1 exited\nrestart 2 in 10 s",
          replica="chat-r1")
    audit("reconciler", "orphan-stopped", None, "stopped server chat-r3")
    audit("reconciler", "orphan-stopped", None, "stopped server chat-r4")
    crashed = AuditEvent.objects.get(action="replica-crashed")
    assert (crashed.count, crashed.message) == (2, "chat-r1 exited\nrestart 2 in 10 s")
    assert AuditEvent.objects.filter(action="orphan-stopped").count() == 2


def test_changes_with_different_before_and_after_are_never_folded(deployment: Any) -> None:
    for before, after in ((1, 2), (2, 3), (2, 3)):
        audit("alice", "deployment-scaled", deployment, f"scaled from {before} to {after}",
              before={"replicas": before}, after={"replicas": after})
    rows = list(AuditEvent.objects.order_by("at").values_list("message", "count"))
    assert rows == [("scaled from 1 to 2", 1), ("scaled from 2 to 3", 2)]


def test_after_the_window_a_repeat_is_a_new_row(deployment: Any, settings: Any) -> None:
    settings.EVENT_COALESCE_SECONDS = 600
    unreachable(deployment)
    seen_ago(AuditEvent.objects.get(), seconds=601)
    unreachable(deployment)
    assert list(AuditEvent.objects.values_list("count", flat=True)) == [1, 1]


def test_a_window_of_zero_keeps_every_occurrence(deployment: Any, settings: Any) -> None:
    settings.EVENT_COALESCE_SECONDS = 0
    unreachable(deployment)
    unreachable(deployment)
    assert AuditEvent.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_writers_coalescing_at_once_lose_no_occurrence(deployment: Any) -> None:
    unreachable(deployment)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(times: int) -> None:
        try:
            start.wait(timeout=30)
            for _ in range(times):
                unreachable(deployment)
        except BaseException as error:  # the assertion below names it
            errors.append(error)
        finally:
            connection.close()  # this thread's own connection

    threads = [threading.Thread(target=write, args=(40,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert list(AuditEvent.objects.values_list("count", flat=True)) == [81]


def old_and_new_events(deployment: Any) -> dict[str, AuditEvent]:
    """An event of each kind and age, by name."""
    made = {}
    for name, action, days in (("old", "replica-unreachable", 31),
                               ("recent", "replica-unreachable", 29),
                               ("old key", "key-created", 31),
                               ("ancient key", "key-revoked", 366),
                               ("old role", "user-role-changed", 200)):
        audit("alice", action, deployment, name)
        made[name] = AuditEvent.objects.get(message=name)
        seen_ago(made[name], days=days)
    return made


def test_pruning_keeps_the_newest_and_security_events_longer(deployment: Any,
                                                             settings: Any) -> None:
    settings.AUDIT_RETENTION_DAYS, settings.AUDIT_SECURITY_RETENTION_DAYS = 30, 365
    old_and_new_events(deployment)
    assert prune_events() == 2
    assert set(AuditEvent.objects.values_list("message", flat=True)) == {
        "recent", "old key", "old role"}


def test_an_event_still_repeating_is_kept_whatever_its_first_sighting(
        deployment: Any, settings: Any) -> None:
    settings.AUDIT_RETENTION_DAYS = 30
    unreachable(deployment)
    AuditEvent.objects.update(at=timezone.now() - timedelta(days=90))
    assert prune_events() == 0
    assert AuditEvent.objects.count() == 1


def test_a_sweep_deletes_in_bounded_batches(deployment: Any, monkeypatch: Any,
                                            settings: Any) -> None:
    settings.EVENT_COALESCE_SECONDS = 0
    monkeypatch.setattr(audit_log, "PRUNE_BATCH", 3)
    for number in range(8):
        audit("reconciler", "replica-unreachable", deployment, f"gone {number}")
    AuditEvent.objects.update(last_seen=timezone.now() - timedelta(days=40))
    with CaptureQueriesContext(connection) as queries:
        assert prune_events(batches=2) == 6
    assert all("LIMIT 3" in q["sql"] for q in queries if q["sql"].startswith("SELECT"))
    assert AuditEvent.objects.count() == 2
    assert prune_events() == 2


def test_prune_events_dry_run_prints_what_would_go_and_deletes_nothing(
        deployment: Any, settings: Any) -> None:
    settings.AUDIT_RETENTION_DAYS, settings.AUDIT_SECURITY_RETENTION_DAYS = 30, 365
    old_and_new_events(deployment)
    out = StringIO()
    call_command("prune_events", "--dry-run", stdout=out)
    assert "replica-unreachable: 1" in out.getvalue()
    assert "key-revoked: 1" in out.getvalue()
    assert "2 events would be deleted; none were" in out.getvalue()
    assert AuditEvent.objects.count() == 5
    out = StringIO()
    call_command("prune_events", stdout=out)
    assert "deleted 2 events" in out.getvalue()
    assert AuditEvent.objects.count() == 3


def test_security_retention_is_never_shorter_than_the_ordinary_one(settings: Any) -> None:
    settings.AUDIT_RETENTION_DAYS, settings.AUDIT_SECURITY_RETENTION_DAYS = 90, 7
    cutoffs = Cutoffs.from_settings()
    assert cutoffs.security == cutoffs.ordinary


@pytest.mark.django_db(transaction=True)
def test_the_controllers_prune_on_their_own(deployment: Any, settings: Any) -> None:
    settings.AUDIT_PRUNE_INTERVAL_SECONDS = 1
    unreachable(deployment)
    seen_ago(AuditEvent.objects.get(), days=400)

    def none_left() -> bool:
        try:
            return not AuditEvent.objects.exists()
        finally:
            connection.close()  # this worker thread's own connection

    async def run_until_pruned() -> bool:
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(run_event_pruning(stop))
        deadline = asyncio.get_running_loop().time() + 60
        gone = False
        while not gone and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            gone = await asyncio.to_thread(none_left)
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        return gone

    assert asyncio.run(run_until_pruned())


def test_the_events_api_shows_count_and_last_seen_last_seen_first(
        admin_client: APIClient, deployment: Any) -> None:
    unreachable(deployment, "chat-r1")
    seen_ago(AuditEvent.objects.get(replica_name="chat-r1"), seconds=60)
    unreachable(deployment, "chat-r2")
    unreachable(deployment, "chat-r1")
    for url in ("/api/v1/events/?deployment=chat", "/api/v1/deployments/chat/events/"):
        page = admin_client.get(url).json()
        assert [(e["replica_name"], e["count"]) for e in page["results"]] == [
            ("chat-r1", 2), ("chat-r2", 1)]
        assert page["results"][0]["last_seen"] > page["results"][0]["at"]
        assert (page["count"], page["count_capped"], page["next"]) == (2, False, None)


@pytest.mark.parametrize(("url", "only"), [("/api/v1/events/", {"deployment": "chat"}),
                                           ("/api/v1/deployments/chat/events/", {})])
def test_the_events_count_is_bounded_and_paging_goes_on_past_it(
        admin_client: APIClient, deployment: Any, settings: Any, url: str,
        only: dict[str, str]) -> None:
    settings.EVENT_COALESCE_SECONDS = 0
    settings.EVENTS_COUNT_LIMIT = 5
    for number in range(8):
        audit("reconciler", "replica-unreachable", deployment, f"probe {number}")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(url, {**only, "limit": "3"}).json()
    assert (page["count"], page["count_capped"]) == (5, True)
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"]]
    assert counts and all("LIMIT 6" in sql for sql in counts)
    last = admin_client.get(url, {**only, "limit": "3", "offset": "6"}).json()
    assert [e["message"] for e in last["results"]] == ["probe 1", "probe 0"]
    assert last["next"] is None and "offset=3" in last["previous"]
    assert "offset=3" in page["next"]


def test_the_deployment_page_shows_each_event_with_its_count(client: Any,
                                                            deployment: Any) -> None:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_superuser("root", password="pw-for-tests")
    client.force_login(user)
    for _ in range(3):
        unreachable(deployment)
    html = client.get("/deployments/chat/").content.decode()
    assert '<td class="count">3</td>' in html
    assert "Last seen" in html


def test_the_admin_lists_events_with_their_count_without_counting_the_whole_log(
        client: Any, deployment: Any, settings: Any) -> None:
    from django.contrib.auth import get_user_model

    settings.EVENT_COALESCE_SECONDS, settings.EVENTS_COUNT_LIMIT = 0, 5
    client.force_login(get_user_model().objects.create_superuser("root", password="pw-tests"))
    for number in range(7):
        audit("reconciler", "replica-unreachable", deployment, f"probe {number}")
    settings.EVENT_COALESCE_SECONDS = 600
    unreachable(deployment)
    unreachable(deployment)
    with CaptureQueriesContext(connection) as queries:
        html = client.get("/admin/controlplane/auditevent/").content.decode()
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"] and "auditevent" in q["sql"]]
    assert counts and all("LIMIT 6" in sql for sql in counts)
    assert '<td class="field-count">2</td>' in html


def test_the_migration_sees_each_existing_event_once_at_its_own_time(deployment: Any) -> None:
    import importlib

    from django.apps import apps

    migration = importlib.import_module("controlplane.migrations.0007_auditevent_count_last_seen")
    unreachable(deployment)
    written = timezone.now() - timedelta(days=3)
    AuditEvent.objects.update(at=written, last_seen=timezone.now())  # as before the column
    migration.seen_when_written(apps, None)
    event = AuditEvent.objects.get()
    assert (event.last_seen, event.count) == (written, 1)


def test_the_api_schema_describes_count_last_seen_and_the_capped_count(
        admin_client: APIClient) -> None:
    schema = admin_client.get("/api/schema/", {"format": "json"}).json()
    paths = schema["paths"]
    pages = {paths[url]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
             ["$ref"] for url in ("/api/v1/events/", "/api/v1/deployments/{name}/events/")}
    assert len(pages) == 1
    page = schema["components"]["schemas"][pages.pop().rsplit("/", 1)[1]]
    assert page["properties"]["count_capped"]["type"] == "boolean"
    event = schema["components"]["schemas"]["AuditEvent"]["properties"]
    assert {"count", "last_seen", "at"} <= set(event)
