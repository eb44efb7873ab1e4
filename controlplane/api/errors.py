"""Maps domain errors to HTTP answers once, for every API view: bad input is a 400 naming
each field, a name already taken or a record still in use is a 409 (`{"detail": ...}`)."""

from __future__ import annotations

from typing import Any

from django.db.models import ProtectedError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from access.roles import UserExists
from controlplane.backends.base import BackendConfigError
from controlplane.services import DeploymentError, NameTakenError
from models_registry.capacity_report import CapacityUnknownError
from models_registry.importers import ModelSourceError
from models_registry.services import ModelConflictError, ModelNameTaken
from serving.services import KeyRequestError, TeamNameTaken


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, NameTakenError | TeamNameTaken | ModelNameTaken | UserExists):
        exc = Conflict(getattr(exc, "message", None) or str(exc))
    elif isinstance(exc, ModelSourceError):
        exc = exceptions.ValidationError({exc.field: [exc.message]})
    elif isinstance(exc, KeyRequestError):
        exc = exceptions.ValidationError({exc.field: [str(exc)]})
    elif isinstance(exc, DeploymentError):
        exc = exceptions.ValidationError({exc.field: [exc.message]})
    elif isinstance(exc, BackendConfigError):
        exc = exceptions.ValidationError({"config": [f"{exc.field}: {exc.message}"]})
    elif isinstance(exc, ModelConflictError | CapacityUnknownError):
        exc = Conflict(str(exc))
    elif isinstance(exc, ProtectedError):
        names = ", ".join(sorted(str(obj) for obj in exc.protected_objects))
        exc = Conflict(f"still in use by: {names}")
    return drf_exception_handler(exc, context)
