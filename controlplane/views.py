from __future__ import annotations

import logging

from django.contrib.auth import views as auth_views
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from controlplane.login import ThrottledAuthenticationForm
from serving.keys import knows_valid_keys
from serving.routes import routes

logger = logging.getLogger(__name__)


def livez(request: HttpRequest) -> JsonResponse:
    """The process answers: the kubelet's liveness probe. Nothing else is asked, so a
    database outage takes the gateway out of the Service (readiness) without restarting
    it (each request runs in its own thread under ASGI: a request stuck on the database
    does not hold this one up)."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """The readiness probe (also `/healthz`): 200 when the database answers. When it does
    not, the gateway can still serve the keys and routes it holds in memory: a process
    that holds both stays ready ("degraded"), so an outage of the database does not take
    every gateway out of the Service; one that holds neither (started during the outage)
    answers 503. The details go to the log, not to anonymous callers."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        logger.warning("readiness: the database does not answer: %s", exc)
        if routes.table.pools and knows_valid_keys():
            return JsonResponse({"status": "degraded", "detail": "the database does not "
                                 "answer (the server's log says why); serving the keys "
                                 "and routes known"})
        return JsonResponse({"status": "unavailable", "detail": "the database does not "
                             "answer (the server's log says why)"}, status=503)
    return JsonResponse({"status": "ok"})


class LoginView(auth_views.LoginView):
    """Django's login page, with failed attempts throttled (controlplane/login.py)."""

    form_class = ThrottledAuthenticationForm
