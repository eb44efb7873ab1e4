"""The live pages: dashboards (/dashboard/, /dashboard/<deployment>/) and the playground
(/playground/). The pages are shells; their figures and answers arrive over WebSockets
(controlplane/consumers.py)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path

from access.roles import role_required
from controlplane.models import Deployment


@role_required("viewer")
def fleet_dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "controlplane/dashboard_fleet.html")


@role_required("viewer")
def deployment_dashboard(request: HttpRequest, name: str) -> HttpResponse:
    deployment = get_object_or_404(Deployment, name=name, deleting=False)
    return render(request, "controlplane/dashboard_deployment.html",
                  {"deployment": deployment})


@role_required("operator")
def playground(request: HttpRequest) -> HttpResponse:
    # The first two, to start from; the others are typed, with suggestions (never a list
    # of every deployment: static/js/suggest.js).
    first = list(Deployment.objects.filter(deleting=False).order_by("name")[:2])
    return render(request, "controlplane/playground.html", {"first": first})


urlpatterns = [
    path("dashboard/", fleet_dashboard, name="dashboard"),
    path("dashboard/<slug:name>/", deployment_dashboard, name="dashboard-deployment"),
    path("playground/", playground, name="playground"),
]
