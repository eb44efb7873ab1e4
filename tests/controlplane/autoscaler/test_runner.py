"""The autoscaler applied: policies through the REST API (refused with the field named,
stored in their checked form), and passes that read the collector's figures, change the
replica count and record events carrying their inputs; a stale collector holds, once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane import collector as collector_module
from controlplane.autoscaler.runner import Autoscaler
from controlplane.collector import MetricsStore
from controlplane.models import AuditEvent, Deployment
from tests.factories import make_deployment, make_model

pytestmark = pytest.mark.django_db
URL = "/api/v1/deployments/"
POLICY = {"signals": [{"name": "waiting_per_replica", "target": 2}],
          "scale_down_window_seconds": 60, "cooldown_seconds": 0}


@pytest.fixture
def store() -> Iterator[MetricsStore]:
    """Stands in for the collector of this process: its store, filled by the test."""
    store = MetricsStore(2.0)
    collector_module.collector = SimpleNamespace(store=store)  # type: ignore[assignment]
    yield store
    collector_module.collector = None


def summary(name: str, **figures: Any) -> dict[str, Any]:
    return {"name": name, "ready": 1, "desired": 1, "standby": 0, "waiting": 0.0,
            "running": 0.0, "kv_cache": 0.1, "tokens_per_s": 0.0, "requests_per_s": 0.0,
            "scrape_failures": 0, **figures}


@pytest.mark.parametrize(("policy", "bounds", "field"), [
    (POLICY, (3, 2), "min_replicas"),
    ({"signals": [{"name": "vibes", "target": 1}]}, (1, 2), "autoscaling.signals[0]"),
    ({"signals": [{"name": "kv_cache", "target": 0}]}, (1, 2), "autoscaling.signals[0]"),
    ({"max_step": -1}, (1, 2), "autoscaling.max_step"),
    ("fast please", (1, 2), "autoscaling"),
])
def test_bad_policies_are_refused_by_the_api(admin_client: APIClient, policy: Any,
                                             bounds: tuple[int, int], field: str) -> None:
    make_model("smollm2")
    response = admin_client.post(URL, {
        "name": "chat", "model": "smollm2", "replicas": 1, "min_replicas": bounds[0],
        "max_replicas": bounds[1], "autoscaling": policy}, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json(), response.json()
    assert not Deployment.objects.exists()


def test_a_policy_is_stored_checked_and_can_be_removed(admin_client: APIClient) -> None:
    make_model("smollm2")
    response = admin_client.post(URL, {
        "name": "chat", "model": "smollm2", "replicas": 1, "min_replicas": 1,
        "max_replicas": 4, "autoscaling": POLICY}, format="json")
    assert response.status_code == 201, response.json()
    stored = response.json()["autoscaling"]
    assert stored["signals"] == [{"name": "waiting_per_replica", "target": 2.0}]
    assert stored["max_step"] == 4 and stored["enabled"] is True  # defaults filled in
    response = admin_client.patch(f"{URL}chat/", {"autoscaling": None}, format="json")
    assert response.status_code == 200 and response.json()["autoscaling"] is None


def test_a_pass_scales_and_records_its_inputs(store: MetricsStore) -> None:
    deployment = make_deployment("chat", model=make_model("llama"), replicas=1,
                                 min_replicas=1, max_replicas=4, autoscaling=POLICY)
    other = make_deployment("manual", model=deployment.model, backend=deployment.backend,
                            replicas=2)
    now = time.time()
    store.fleet = {"t": now, "deployments": [summary("chat", waiting=7.0),
                                            summary("manual", waiting=50.0)]}
    [(name, decision)] = Autoscaler().run_once(now=now)
    assert (name, decision.desired) == ("chat", 4)
    deployment.refresh_from_db()
    other.refresh_from_db()
    assert deployment.replicas == 4 and other.replicas == 2  # no policy: left alone
    event = AuditEvent.objects.get(action="autoscaled")
    assert event.actor == "autoscaler" and event.message.startswith("1 -> 4 replicas")
    assert event.after is not None
    assert event.after["signals"]["waiting_per_replica"] == {
        "value": 7.0, "target": 2.0, "proposes": 4}


def test_a_deployment_kubernetes_scales_itself_gets_no_decision(store: MetricsStore) -> None:
    """With an HPA or KEDA the platform sets the count: the control plane's autoscaler
    never writes it beside them (its policy only makes the gateway hold requests)."""
    from tests.factories import make_backend

    keda = make_backend("gpus", "kubernetes", {"namespace": "inference", "scaling": "keda",
                                               "model_source": "pvc", "pvc_name": "models"})
    deployment = make_deployment("chat", model=make_model("llama"), backend=keda,
                                 replicas=1, min_replicas=0, max_replicas=4,
                                 autoscaling=POLICY)
    now = time.time()
    store.fleet = {"t": now, "deployments": [summary("chat", waiting=7.0)]}
    assert Autoscaler().run_once(now=now) == []
    deployment.refresh_from_db()
    assert deployment.replicas == 1
    assert not AuditEvent.objects.filter(action="autoscaled").exists()


def test_a_stale_collector_holds_and_says_so_once(store: MetricsStore) -> None:
    deployment = make_deployment("chat", model=make_model("llama"), replicas=3,
                                 min_replicas=1, max_replicas=4, autoscaling=POLICY)
    now = time.time()
    store.fleet = {"t": now - 60, "deployments": [summary("chat", waiting=0.0)]}
    autoscaler = Autoscaler()
    for step in range(5):
        [(_, decision)] = autoscaler.run_once(now=now + 2 * step)
        assert decision.desired == 3
    deployment.refresh_from_db()
    assert deployment.replicas == 3
    [held] = AuditEvent.objects.filter(action="autoscaler-holding")
    assert "no recent metrics" in held.message


def test_a_scale_up_promotes_a_ready_standby_in_the_same_pass(store: MetricsStore) -> None:
    from controlplane.models import Replica
    from controlplane.routing import current_pools
    from serving.routes import routes

    deployment = make_deployment("chat", model=make_model("llama"), replicas=1, standby=1,
                                 min_replicas=1, max_replicas=2, autoscaling=POLICY)
    for name, role in (("chat-1", "active"), ("chat-2", "standby")):
        Replica.objects.create(deployment=deployment, name=name, phase="ready", role=role,
                               endpoint=f"http://127.0.0.1:9/{name}")
    [pool] = current_pools()
    assert [r.name for r in pool.replicas] == ["chat-1"]
    now = time.time()
    store.fleet = {"t": now, "deployments": [summary("chat", waiting=9.0)]}
    [(_, decision)] = Autoscaler().run_once(now=now)
    assert decision.desired == 2
    # Not left for the next reconcile pass: the standby takes traffic now.
    assert Replica.objects.get(name="chat-2").role == "active"
    published = routes.table.routes_for("chat")  # what the gateway routes by
    assert published is not None
    assert sorted(r.name for r in published.replicas) == ["chat-1", "chat-2"]
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True))
    assert actions[-2:] == ["autoscaled", "replica-promoted"]


def test_every_decision_is_charted_with_its_inputs_steady_ones_too(
        store: MetricsStore) -> None:
    make_deployment("chat", model=make_model("llama"), replicas=2, min_replicas=1,
                    max_replicas=4, autoscaling=POLICY)
    autoscaler = Autoscaler()
    now = time.time()
    for step, waiting in enumerate((4.0, 4.0, 7.0)):  # steady, steady, then up
        at = now + 2 * step
        store.gateway_series("chat").append({"t": round(at, 3), "desired": 2})
        store.fleet = {"t": at, "deployments": [summary("chat", waiting=waiting)]}
        autoscaler.run_once(now=at)
    messages, autoscaler.charted = autoscaler.charted, []
    assert [m["decision"]["reason"].split(":")[0] for m in messages] == [
        "steady", "steady", "scaling up"]
    # A dashboard that connects later gets them with the history.
    history = store.deployment_history("chat")["gateway"]
    assert [s["decided"] for s in history] == [2, 2, 4]
    assert history[0]["decision"]["signals"] == {
        "waiting_per_replica": {"value": 4.0, "target": 2.0, "proposes": 2}}
    assert messages[-1]["t"] == history[-1]["t"] and messages[-1]["deployment"] == "chat"
    # Only the change is an event: steady passes keep the log readable.
    assert list(AuditEvent.objects.values_list("action", flat=True)) == ["autoscaled"]


def test_with_no_policy_anywhere_passes_skip_the_database_until_the_fleet_changes(
        store: MetricsStore) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from controlplane.reconciler.schedule import note_fleet_changed

    note_fleet_changed()  # a reconciler runs in this process (the embedded default)
    deployment = make_deployment("manual", model=make_model("llama"), replicas=1,
                                 min_replicas=1, max_replicas=4)
    autoscaler = Autoscaler()
    assert not autoscaler.nothing_to_decide()  # nothing known before a first pass
    with CaptureQueriesContext(connection) as queries:
        assert autoscaler.run_once() == []
    assert len(queries.captured_queries) == 1
    assert autoscaler.nothing_to_decide()  # an idle fleet: no query, no thread, per pass
    # A policy set: its event makes the reconciler's next pass full, which is what the
    # autoscaler follows; the next pass decides for the deployment.
    Deployment.objects.filter(pk=deployment.pk).update(autoscaling=POLICY)
    note_fleet_changed()
    assert not autoscaler.nothing_to_decide()
    now = time.time()
    store.fleet = {"t": now, "deployments": [summary("manual", waiting=7.0)]}
    [(name, decision)] = autoscaler.run_once(now=now)
    assert (name, decision.desired) == ("manual", 4)
    assert not autoscaler.nothing_to_decide()  # a policy somewhere: every pass decides


def test_without_a_reconciler_beside_every_pass_asks_the_database(
        store: MetricsStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.reconciler import schedule

    monkeypatch.setattr(schedule, "_fleet_revision", 0)  # nothing tells of changes here
    autoscaler = Autoscaler()
    assert autoscaler.run_once() == []
    assert not autoscaler.nothing_to_decide()
