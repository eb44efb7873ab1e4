"""The live pages: dashboards (/dashboard/, /dashboard/<deployment>/) and the playground
(/playground/). The pages are shells; their figures and answers arrive over WebSockets
(controlplane/consumers.py)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path

from controlplane.consumers import can_view
from controlplane.models import Deployment


def _check(request: HttpRequest) -> None:
    if not can_view(request.user):
        raise PermissionDenied("your account may not see deployments")


@login_required(login_url="login")
def fleet_dashboard(request: HttpRequest) -> HttpResponse:
    _check(request)
    return render(request, "controlplane/dashboard_fleet.html")


@login_required(login_url="login")
def deployment_dashboard(request: HttpRequest, name: str) -> HttpResponse:
    _check(request)
    deployment = get_object_or_404(Deployment, name=name, deleting=False)
    return render(request, "controlplane/dashboard_deployment.html",
                  {"deployment": deployment})


@login_required(login_url="login")
def playground(request: HttpRequest) -> HttpResponse:
    _check(request)
    deployments = Deployment.objects.filter(deleting=False).order_by("name")
    return render(request, "controlplane/playground.html", {"deployments": deployments})


urlpatterns = [
    path("dashboard/", fleet_dashboard, name="dashboard"),
    path("dashboard/<slug:name>/", deployment_dashboard, name="dashboard-deployment"),
    path("playground/", playground, name="playground"),
]
