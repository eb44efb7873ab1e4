from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.db import connection
from django.http import HttpRequest, JsonResponse

from controlplane.login import ThrottledAuthenticationForm


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness and database reachability, for probes."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


class LoginView(auth_views.LoginView):
    """Django's login page, with failed attempts throttled (controlplane/login.py)."""

    form_class = ThrottledAuthenticationForm
