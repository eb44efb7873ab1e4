"""Pages of deployments: the list (with a create form) and a deployment's page (replicas,
phases, time to ready, logs, events, and the scale, stop, start, restart, delete actions)."""

from __future__ import annotations

import hashlib
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.urls import path
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from access.listing import Filters, filtered_page, page_of
from access.redaction import redact
from access.roles import has_role, role_required
from controlplane import filters, services
from controlplane.forms import DeploymentForm, ScaleForm
from controlplane.models import AuditEvent, Deployment, Replica

# A deployment page's replicas: by phase or part of the name.
DETAIL_REPLICAS = Filters(search=("name",), choices=filters.REPLICAS.choices)


def first_error(exc: ValidationError) -> str:
    detail: Any = exc.detail
    while isinstance(detail, dict | list):
        if isinstance(detail, dict):
            key, detail = next(iter(detail.items()))
            if isinstance(detail, list) and detail and isinstance(detail[0], str):
                return f"{key}: {detail[0]}"
        else:
            detail = detail[0]
    return str(detail)


@role_required("viewer")
def deployment_list(request: HttpRequest) -> HttpResponse:
    form = DeploymentForm(request.POST or None)
    if request.method == "POST" and not has_role(request.user, "operator"):
        raise PermissionDenied("creating a deployment needs the operator role")
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            deployment = services.create_deployment(services.DeploymentSpec(
                name=data["name"], model=data["model"],
                backend=data["backend"] or services.default_local_backend(),
                engine_args=form.engine_args_value(), replicas=data["replicas"],
                max_replicas=data["max_replicas"]), actor=request.user.get_username())
        except services.DeploymentError as exc:
            form.add_error(None, f"{exc.field}: {exc.message}")
        except ValidationError as exc:
            form.add_error(None, first_error(exc))
        else:
            messages.success(request, f"Deployment {deployment.name} created.")
            return redirect("deployment-page", name=deployment.name)
    # Only what a row shows: not the engine args, settings, key, model shape or backend
    # config of every deployment on the page.
    deployments = filters.with_ready_count(
        Deployment.objects.select_related("model", "backend").only(
            "name", "state", "deleting", "replicas", "conditions", "model__name",
            "backend__name", "backend__kind"))
    page, given, error = filtered_page(request, deployments, filters.DEPLOYMENTS)
    context = {"page": page, "given": given, "filtered": bool(given),
               "filter_error": error, "form": form, "states": Deployment.State.choices}
    if request.headers.get("X-Fragment") == "deployment-list":
        return fragment(request, "controlplane/deployment_rows.html", context)
    return render(request, "controlplane/deployment_list.html", context,
                  status=400 if error else 200)


def fragment(request: HttpRequest, template: str, context: dict[str, Any]) -> HttpResponse:
    """One part of a page, for its own refresh (static/js/refresh.js): 304 when it is what
    the browser holds already (its ETag), so an unchanged list costs no bytes."""
    body = render_to_string(template, context, request=request).encode()
    tag = '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'
    if request.headers.get("If-None-Match") == tag:
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(body)
    response["ETag"] = tag
    response["Cache-Control"] = "no-store"
    return response


@role_required("viewer")
def deployment_detail(request: HttpRequest, name: str) -> HttpResponse:
    deployment = get_object_or_404(Deployment.objects.select_related("model", "backend"),
                                   name=name)
    replicas, given, error = filtered_page(
        request, Replica.objects.filter(deployment=deployment), DETAIL_REPLICAS,
        param="replicas_page")
    events = page_of(request, AuditEvent.objects.filter(deployment=deployment),
                     param="events_page")
    # Shown, never saved: an external endpoint's URL and an error may carry credentials.
    for replica in replicas.rows:
        replica.endpoint, replica.last_error = (redact(replica.endpoint),
                                                redact(replica.last_error))
    for event in events.rows:
        event.message = redact(event.message)
    deployment.conditions = redact(deployment.conditions)
    return render(request, "controlplane/deployment_detail.html", {
        "deployment": deployment, "replicas": replicas, "events": events,
        "given": given, "filter_error": error, "phases": Replica.Phase.choices,
        "scale_form": ScaleForm(initial={"replicas": deployment.replicas}),
        "ready": Replica.objects.filter(deployment=deployment,
                                        phase=Replica.Phase.READY).count(),
    }, status=400 if error else 200)


@role_required("operator")
@require_POST
def deployment_action(request: HttpRequest, name: str, verb: str) -> HttpResponse:
    deployment = get_object_or_404(Deployment, name=name)
    actor = request.user.get_username()
    try:
        if verb == "scale":
            form = ScaleForm(request.POST)
            if not form.is_valid():
                messages.error(request, "replicas: " + " ".join(map(str, form.errors["replicas"])))
                return redirect("deployment-page", name=name)
            services.scale_deployment(deployment, form.cleaned_data["replicas"], actor=actor)
        elif verb == "stop":
            services.set_deployment_state(deployment, Deployment.State.STOPPED, actor=actor)
        elif verb == "start":
            services.set_deployment_state(deployment, Deployment.State.RUNNING, actor=actor)
        elif verb == "restart":
            services.restart_deployment(deployment, actor=actor)
        elif verb == "delete":
            services.delete_deployment(deployment, actor=actor)
            messages.success(request, f"Deployment {name} is being deleted.")
            return redirect("deployments")
        else:
            return HttpResponse(status=404)
    except services.DeploymentError as exc:
        messages.error(request, f"{exc.field}: {exc.message}")
    else:
        messages.success(request, f"{verb.capitalize()} requested.")
    return redirect("deployment-page", name=name)


urlpatterns = [
    path("", deployment_list, name="deployments"),
    path("<slug:name>/", deployment_detail, name="deployment-page"),
    path("<slug:name>/<str:verb>/", deployment_action, name="deployment-action"),
]
