"""The console's lists at fleet size: deployments, models, keys and a deployment's replicas
and events come a page at a time, filtered and searched through query parameters that
every link keeps; a page number that means nothing is clamped and said so, a filter that
means nothing is named; the deployment form takes typed names, not a list of every object."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from controlplane.models import AuditEvent, Deployment, Replica
from models_registry.models import Model
from serving.services import create_api_key, create_team, revoke_api_key
from tests.factories import make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    return client


@pytest.fixture
def fleet(db: None) -> None:
    """120 deployments: 60 on model `alpha` (backend `edge`), 60 on `beta` (`core`); every
    third one stopped."""
    models = {"alpha": make_model("alpha"), "beta": make_model("beta")}
    backends = {"alpha": make_backend("edge", "external", {"url": "http://127.0.0.1:9"}),
                "beta": make_backend("core")}
    Deployment.objects.bulk_create([Deployment(
        name=f"fleet-{i:03d}", model=models["alpha" if i % 2 else "beta"],
        backend=backends["alpha" if i % 2 else "beta"],
        state="stopped" if i % 3 == 0 else "running") for i in range(120)])


def rows(html: str, attribute: str = "data-deployment") -> list[str]:
    return re.findall(rf'<tr {attribute}="([^"]+)"', html)


def test_the_deployment_list_shows_one_page_and_links_to_the_next(admin: Client,
                                                                  fleet: None) -> None:
    html = admin.get("/deployments/").content.decode()
    assert rows(html) == [f"fleet-{i:03d}" for i in range(50)]
    assert "rows 1 to 50 of 120" in html and "page 1 of 3" in html
    assert 'rel="next" href="?page=2"' in html and 'rel="prev"' not in html
    last = admin.get("/deployments/", {"page": "3"}).content.decode()
    assert rows(last) == [f"fleet-{i:03d}" for i in range(100, 120)]
    assert 'rel="next"' not in last and 'rel="prev" href="?page=2"' in last


def test_filters_narrow_the_list_and_survive_in_its_links(admin: Client,
                                                          fleet: None) -> None:
    html = admin.get("/deployments/", {"search": "fleet", "state": "running"}).content.decode()
    expected = [f"fleet-{i:03d}" for i in range(120) if i % 3]
    assert rows(html) == expected[:50] and "rows 1 to 50 of 80" in html
    assert 'rel="next" href="?search=fleet&amp;state=running&amp;page=2"' in html
    assert rows(admin.get("/deployments/", {"model": "alpha", "state": "running"})
                .content.decode()) == [f"fleet-{i:03d}" for i in range(120) if i % 2 and i % 3]
    assert rows(admin.get("/deployments/", {"backend": "core", "search": "fleet-01"})
                .content.decode()) == [f"fleet-{i:03d}" for i in range(10, 20, 2)]
    assert rows(admin.get("/deployments/", {"search": "BETA"}).content.decode())[:2] == [
        "fleet-000", "fleet-002"]  # the model's name, case-insensitive
    nothing = admin.get("/deployments/", {"search": "no-such"}).content.decode()
    assert rows(nothing) == [] and "No deployment matches." in nothing


@pytest.mark.parametrize(("page", "shown", "notice"), [
    ("abc", "fleet-000", "page must be a whole number from 1: showing page 1"),
    ("-1", "fleet-000", "page must be a whole number from 1: showing page 1"),
    ("0", "fleet-000", "page must be a whole number from 1: showing page 1"),
    ("4", "fleet-100", "there are 3 pages: showing the last"),
    ("99999999999999999999999", "fleet-100", "there are 3 pages: showing the last"),
])
def test_a_page_number_that_means_nothing_is_clamped_and_said_so(
        admin: Client, fleet: None, page: str, shown: str, notice: str) -> None:
    response = admin.get("/deployments/", {"page": page})
    html = response.content.decode()
    assert response.status_code == 200 and rows(html)[0] == shown and notice in html


@pytest.mark.parametrize(("query", "message"), [
    ({"state": "sleeping"}, "state: must be one of running, stopped"),
    ({"search": "x" * 101}, "search: at most 100 characters"),
    ({"model": "a\x00b"}, "model: may not hold NUL characters"),
])
def test_a_filter_that_means_nothing_is_named_not_ignored(
        admin: Client, fleet: None, query: dict[str, str], message: str) -> None:
    response = admin.get("/deployments/", query)
    assert response.status_code == 400
    assert message in response.content.decode() and rows(response.content.decode()) == []


def test_the_list_refreshes_its_own_page_and_sends_nothing_when_it_did_not_change(
        admin: Client, fleet: None) -> None:
    fragment = admin.get("/deployments/", {"page": "2", "model": "beta"},
                         HTTP_X_FRAGMENT="deployment-list")
    html = fragment.content.decode()
    assert html.startswith('<div id="deployment-list"') and "<h1>" not in html
    assert rows(html) == [f"fleet-{i:03d}" for i in range(100, 120, 2)]
    tag = fragment["ETag"]
    unchanged = admin.get("/deployments/", {"page": "2", "model": "beta"},
                          HTTP_X_FRAGMENT="deployment-list", HTTP_IF_NONE_MATCH=tag)
    assert unchanged.status_code == 304 and unchanged.content == b""
    Deployment.objects.filter(name="fleet-100").update(state="stopped")
    changed = admin.get("/deployments/", {"page": "2", "model": "beta"},
                        HTTP_X_FRAGMENT="deployment-list", HTTP_IF_NONE_MATCH=tag)
    assert changed.status_code == 200 and changed["ETag"] != tag


def test_the_deployment_form_lists_no_models_or_backends(admin: Client, fleet: None) -> None:
    html = admin.get("/deployments/").content.decode()
    form = html[html.index('id="deployment-form"'):]
    assert "<option" not in form and "<select" not in form
    assert 'name="model"' in form and 'list="model-names"' in form
    assert 'data-suggest="/api/v1/backends/?limit=10&amp;search="' in form


@pytest.mark.parametrize(("model", "backend", "error"), [
    ("gamma", "", "no model named &#x27;gamma&#x27;"),
    ("alpha", "nowhere", "no backend named &#x27;nowhere&#x27;"),
    ("importing", "", "model &#x27;importing&#x27; is not ready (importing)"),
])
def test_an_unknown_name_in_the_form_is_named(admin: Client, fleet: None, model: str,
                                              backend: str, error: str) -> None:
    make_model("importing", status=Model.Status.IMPORTING)
    response = admin.post("/deployments/", {"name": "new-one", "model": model,
                                            "backend": backend, "replicas": "1",
                                            "max_replicas": "4"})
    assert error in response.content.decode()
    assert not Deployment.objects.filter(name="new-one").exists()


def test_a_typed_model_and_backend_name_deploy(admin: Client, fleet: None) -> None:
    response = admin.post("/deployments/", {"name": "new-one", "model": "alpha",
                                            "backend": "edge", "replicas": "1",
                                            "max_replicas": "4"})
    assert response.status_code == 302 and response["Location"] == "/deployments/new-one/"
    created = Deployment.objects.get(name="new-one")
    assert (created.model.name, created.backend.name) == ("alpha", "edge")


def test_a_deployment_page_pages_its_replicas_and_events_apart(admin: Client) -> None:
    deployment = make_deployment("wide")
    Replica.objects.bulk_create([Replica(deployment=deployment, name=f"wide-{i:03d}",
                                         phase="ready" if i % 2 else "failed")
                                 for i in range(70)])
    AuditEvent.objects.bulk_create([AuditEvent(deployment=deployment, actor="reconciler",
                                               action="replica-started",
                                               message=f"event {i}") for i in range(60)])
    html = admin.get("/deployments/wide/", {"events_page": "2"}).content.decode()
    assert len(rows(html, "data-replica")) == 50 and "rows 1 to 50 of 70" in html
    assert "rows 51 to 60 of 60" in html  # the events' second page
    assert 'href="?events_page=2&amp;replicas_page=2"' in html  # each keeps the other
    assert "<strong>35</strong> of" in html  # ready replicas: all of them, not the page's
    failed = admin.get("/deployments/wide/", {"phase": "failed"}).content.decode()
    assert rows(failed, "data-replica")[:2] == ["wide-000", "wide-002"]
    assert "rows 1 to 35 of 35" in failed


def test_the_model_list_pages_and_searches(admin: Client) -> None:
    Model.objects.bulk_create([Model(name=f"m-{i:03d}", source="local",
                                     status="ready" if i % 4 else "failed",
                                     architecture="Qwen2" if i % 5 == 0 else "Llama")
                               for i in range(75)])
    html = admin.get("/models/").content.decode()
    assert len(rows(html, "data-model")) == 50 and "rows 1 to 50 of 75" in html
    found = admin.get("/models/", {"search": "qwen2", "status": "failed"}).content.decode()
    assert rows(found, "data-model") == [f"m-{i:03d}" for i in range(0, 75, 20)]
    assert admin.get("/models/", {"status": "asleep"}).status_code == 400


def test_the_key_list_pages_filters_and_the_form_takes_a_typed_team(admin: Client) -> None:
    create_team("blue")
    for number in range(55):
        create_api_key(f"key-{number:02d}", "inference", team="blue" if number < 5 else None)
    revoke_api_key(__import__("serving.models", fromlist=["ApiKey"]).ApiKey.objects.get(
        name="key-03"))
    html = admin.get("/keys/").content.decode()
    assert len(rows(html, "data-key")) == 50 and "rows 1 to 50 of 55" in html
    blue = admin.get("/keys/", {"team": "blue", "state": "active"}).content.decode()
    assert sorted(rows(blue, "data-key")) == ["key-00", "key-01", "key-02", "key-04"]
    form = html[html.index('id="key-form"'):html.index("</form>", html.index('id="key-form"'))]
    assert 'name="team"' in form and "blue</option>" not in form
    refused = admin.post("/keys/", {"form": "key", "name": "k", "scope": "inference",
                                    "team": "green", "priority": "standard"})
    assert "no team named &#x27;green&#x27;" in refused.content.decode()
