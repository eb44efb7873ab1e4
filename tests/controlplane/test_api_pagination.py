"""Every list of the REST API is paged with a capped `limit`, and every count in a query
string (limit, offset, a log's lines) is a whole number in range or a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.models import Replica
from serving.services import create_team
from tests.factories import make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db

LISTS = ["/api/v1/models/", "/api/v1/backends/", "/api/v1/deployments/",
         "/api/v1/replicas/", "/api/v1/events/", "/api/v1/keys/", "/api/v1/teams/",
         "/api/v1/users/", "/api/v1/deployments/demo/events/"]


@pytest.fixture
def fleet(db: None) -> None:
    backend = make_backend("edge", "external", {"url": "http://127.0.0.1:9"})
    deployment = make_deployment("demo", model=make_model("demo"), backend=backend)
    Replica.objects.create(deployment=deployment, name="demo-0", endpoint="http://127.0.0.1:9")


def test_a_limit_above_api_max_page_size_is_cut_to_it(admin_client: APIClient,
                                                      settings: Any) -> None:
    settings.API_MAX_PAGE_SIZE = 3
    for number in range(5):
        create_team(f"team-{number}")
    page = admin_client.get("/api/v1/teams/", {"limit": 1_000_000}).json()
    assert [team["name"] for team in page["results"]] == ["team-0", "team-1", "team-2"]
    assert page["count"] == 5 and "limit=3" in page["next"]


@pytest.mark.parametrize("value", ["abc", "-1", "0", "1.5", "1e3", "99999999999999999999x",
                                   ""])
def test_a_limit_that_is_not_a_whole_number_from_1_is_a_400_naming_it(
        admin_client: APIClient, fleet: None, value: str) -> None:
    answers = {url: admin_client.get(url, {"limit": value}) for url in LISTS}
    assert {url: answer.status_code for url, answer in answers.items()} == dict.fromkeys(
        LISTS, 400)
    assert all("limit" in answer.json() for answer in answers.values())


@pytest.mark.parametrize("value", ["abc", "-1", "2147483648", ""])
def test_an_offset_that_is_not_a_whole_number_in_range_is_a_400_naming_it(
        admin_client: APIClient, fleet: None, value: str) -> None:
    answers = {url: admin_client.get(url, {"offset": value}) for url in LISTS}
    assert {url: answer.status_code for url, answer in answers.items()} == dict.fromkeys(
        LISTS, 400)
    assert all("offset" in answer.json() for answer in answers.values())


def test_a_limit_given_twice_is_a_400(admin_client: APIClient, fleet: None) -> None:
    response = admin_client.get("/api/v1/deployments/?limit=1&limit=500")
    assert response.status_code == 400 and "limit" in response.json()


@pytest.mark.parametrize("query", ["lines=abc", "lines=-5", "lines=0", "lines=5001",
                                   "lines=1&lines=2", "follow=maybe"])
def test_a_log_query_out_of_range_is_a_400_naming_it(admin_client: APIClient, fleet: None,
                                                     query: str) -> None:
    response = admin_client.get(f"/api/v1/replicas/demo-0/logs/?{query}")
    assert response.status_code == 400
    assert query.split("=")[0] in response.json()


def test_a_log_tail_within_range_is_answered(admin_client: APIClient, fleet: None) -> None:
    response = admin_client.get("/api/v1/replicas/demo-0/logs/", {"lines": 5000})
    assert response.status_code == 200
    assert response.json() == {"replica": "demo-0", "lines": []}
