from __future__ import annotations

import logging

from django.contrib.auth import views as auth_views
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from controlplane.login import ThrottledAuthenticationForm

logger = logging.getLogger(__name__)


def livez(request: HttpRequest) -> JsonResponse:
    """The process answers: the kubelet's liveness probe. Nothing else is asked, so a
    database outage takes the gateway out of the Service (readiness) without restarting
    it (each request runs in its own thread under ASGI: a request stuck on the database
    does not hold this one up)."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """The database answers: the readiness probe (also `/healthz`). 503 with the reason
    when it does not; the details go to the log, not to anonymous callers."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        logger.warning("readiness: the database does not answer: %s", exc)
        return JsonResponse({"status": "unavailable", "detail": "the database does not "
                             "answer (the server's log says why)"}, status=503)
    return JsonResponse({"status": "ok"})


class LoginView(auth_views.LoginView):
    """Django's login page, with failed attempts throttled (controlplane/login.py)."""

    form_class = ThrottledAuthenticationForm
