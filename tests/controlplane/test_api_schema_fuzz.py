"""The REST API fuzzed from its own OpenAPI schema (schemathesis), in-process.

Every operation of `/api/schema/` is called with an admin key: with schema-valid data
(which must be accepted, answered with a documented 401/403/404/409, or refused with a 400
naming only fields listed in CROSS_CHECKED below) and schema-violating data (which must be
refused), and every answer must be one the schema declares: its status code, its content
type and its body, never a 5xx. A client generated from the schema then works.

The deployments it may create, start, scale or delete use an external backend on an
unused loopback port, and no controller runs in the test: nothing the fuzzer does can start
a vLLM process. The examples are bounded and derandomized: the same cases on every run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from controlplane.models import Backend, Replica
from serving.models import ApiKey
from tests.factories import make_api_key, make_backend, make_deployment, make_model

# Per operation; with about 40 operations this keeps the test to a couple of minutes on
# two cores.
MAX_EXAMPLES = 25


def openapi_document() -> dict[str, Any]:
    """The document /api/schema/ serves, made the same way (no request needed)."""
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.renderers import OpenApiJsonRenderer

    document = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(document))


schema = schemathesis.openapi.from_dict(openapi_document(), config=SchemathesisConfig.from_dict({
    "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
    "seed": 14,
}))
schema.app = get_wsgi_application()


@pytest.fixture
def admin_headers(db: None, settings: Any) -> Iterator[dict[str, str]]:
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "localhost"]
    # The WSGI handler would close the test's connection (and its transaction) at each
    # request's start and end; Django's own test client unhooks this the same way.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    # Something to find behind every lookup: a model, a backend that starts nothing, a
    # deployment with a replica.
    model = make_model("demo")
    backend = make_backend("external", kind="external",
                           config={"url": "http://127.0.0.1:9", "api_key": "sk-upstream"})
    deployment = make_deployment("demo", model=model, backend=backend)
    Replica.objects.create(deployment=deployment, name="demo-0", endpoint="http://127.0.0.1:9")
    key = make_api_key(ApiKey.Scope.ADMIN, name="fuzz")
    try:
        yield {"Authorization": f"Bearer {key}"}
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


# Rules no JSON schema can state: they depend on other records (a model that exists and is
# ready, a backend, a team, a user, a model folder on disk) or on several fields together
# (replicas within min_replicas..max_replicas, a source and its path). A schema-valid body
# may be refused for these fields only, and only with a 400 naming them; any other refusal
# of schema-valid data fails the test as schemathesis' own check would.
CROSS_CHECKED: dict[tuple[str, str], set[str]] = {
    ("POST", "/api/v1/backends/"): {"config"},
    ("PATCH", "/api/v1/backends/{name}/"): {"config"},
    ("POST", "/api/v1/deployments/"): {"model", "backend", "replicas", "min_replicas",
                                       "max_replicas", "standby", "aliases", "engine_args",
                                       "autoscaling", "admission"},
    ("PATCH", "/api/v1/deployments/{name}/"): {"model", "replicas", "min_replicas",
                                               "max_replicas", "standby", "aliases",
                                               "engine_args", "autoscaling", "admission"},
    ("POST", "/api/v1/deployments/{name}/scale/"): {"replicas"},
    ("POST", "/api/v1/keys/"): {"team", "user", "models", "expires_at"},
    ("POST", "/api/v1/models/"): {"path", "hf_id", "package"},
    ("PATCH", "/api/v1/users/{username}/"): {"username", "role"},
}


def first_segment(field: object) -> str:
    return str(field).split(".")[0]


def positive_data_acceptance_but_cross_checked_fields(ctx: Any, response: Any,
                                                      case: Any) -> bool | None:
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive and response.status_code == 400:
        allowed = CROSS_CHECKED.get((case.method.upper(), case.operation.path), set())
        body = response.json()
        fields = {first_segment(name) for name in body} if isinstance(body, dict) else set()
        assert fields and fields <= allowed, (
            f"schema-valid data refused for {sorted(fields) or body} "
            f"(only {sorted(allowed)} depend on more than the schema says)")
        return None
    return positive_data_acceptance(ctx, response, case)


@schema.parametrize()
@hypothesis_settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_its_schema_says(case: Any,
                                                    admin_headers: dict[str, str]) -> None:
    case.call_and_validate(
        headers=admin_headers, excluded_checks=[positive_data_acceptance],
        additional_checks=[positive_data_acceptance_but_cross_checked_fields])


# Found by the fuzzer on PostgreSQL, which refuses NUL characters in text and JSON with an
# error (a 500) where SQLite stores them: kept here, named, for both database passes.
@pytest.mark.parametrize("path", ["/api/v1/deployments/a%00b/", "/api/v1/backends/a%00/",
                                  "/api/v1/teams/a%00/", "/api/v1/replicas/a%00/logs/",
                                  "/api/v1/keys/1%00/", "/api/v1/events/1%00/",
                                  "/api/v1/deployments/%0Ax/scale/"])
def test_a_nul_or_newline_in_a_path_is_a_json_404(admin_client: APIClient, path: str) -> None:
    response = admin_client.get(path)
    assert (response.status_code, response.json()) == (404, {"detail": "Not found."})


def test_a_nul_in_a_filter_is_a_400_naming_it(admin_client: APIClient) -> None:
    response = admin_client.get("/api/v1/events/?actor=a%00")
    assert response.status_code == 400 and "actor" in response.json()


@pytest.mark.parametrize("text", ["x\u0000y", "x\ud800y"])
def test_text_no_database_can_store_is_a_400_naming_the_field(admin_client: APIClient,
                                                               text: str) -> None:
    body = json.dumps({"name": "box", "kind": "local", "config": {"env": {"A": text}}})
    response = admin_client.post("/api/v1/backends/", body, content_type="application/json")
    assert response.status_code == 400 and "config" in response.json()
    assert not Backend.objects.exists()
