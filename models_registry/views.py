"""Pages of the registry: the model list (with a form to register one) and a model page
with its capacity estimate."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from access.listing import filtered_page
from access.roles import has_role, role_required
from models_registry import services
from models_registry.capacity import DEFAULT_SEQUENCE_LENGTH, MEMORY_PRESETS_GIB
from models_registry.capacity_report import CapacityUnknownError, model_capacity
from models_registry.filters import MODEL_FILTERS
from models_registry.forms import CapacityForm, RegisterModelForm
from models_registry.importers import ModelSourceError
from models_registry.models import Model


@role_required("viewer")
def model_list(request: HttpRequest) -> HttpResponse:
    form = RegisterModelForm(request.POST or None)
    if request.method == "POST" and not has_role(request.user, "operator"):
        raise PermissionDenied("registering a model needs the operator role")
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        spec = services.ModelSpec(name=data["name"], source=data["source"],
                                  uri=data["location"], display_name=data["display_name"])
        try:
            model = services.register_model(spec, actor=request.user.get_username())
        except ModelSourceError as exc:
            form.add_error("location" if exc.field in ("path", "hf_id", "package") else exc.field,
                           exc.message)
        else:
            messages.success(request, f"Model {model.name} registered ({model.status}).")
            return redirect("registry")
    page, given, error = filtered_page(request, Model.objects.all(), MODEL_FILTERS)
    rows: list[dict[str, Any]] = []
    for model in page.rows:  # the capacity of this page's models only
        try:
            estimates = model_capacity(model)
        except CapacityUnknownError:
            estimates = []
        rows.append({"model": model, "estimates": estimates})
    return render(request, "models_registry/model_list.html", {
        "rows": rows, "page": page, "given": given, "filtered": bool(given),
        "filter_error": error, "statuses": Model.Status.choices,
        "tasks": Model.Task.choices, "form": form, "presets": MEMORY_PRESETS_GIB,
        "sequence_length": DEFAULT_SEQUENCE_LENGTH,
    }, status=400 if error else 200)


@role_required("viewer")
def model_detail(request: HttpRequest, name: str) -> HttpResponse:
    model = get_object_or_404(Model, name=name)
    form = CapacityForm(request.GET or None)
    estimates = []
    capacity_error = ""
    arguments = form.estimate_arguments() if form.is_valid() else {}
    try:
        estimates = model_capacity(model, **arguments)  # type: ignore[arg-type]
    except CapacityUnknownError as exc:
        capacity_error = str(exc)
    return render(request, "models_registry/model_detail.html", {
        "model": model, "form": form if request.GET else CapacityForm(),
        "estimates": estimates, "capacity_error": capacity_error,
        "kv_bytes_per_token": model.kv_bytes_per_token(),
        "sequence_length": arguments.get("sequence_length", DEFAULT_SEQUENCE_LENGTH),
    })


@role_required("operator")
def model_delete(request: HttpRequest, name: str) -> HttpResponse:
    model = get_object_or_404(Model, name=name)
    if request.method == "POST":
        try:
            services.delete_model(model, actor=request.user.get_username())
        except services.ModelConflictError as exc:
            messages.error(request, str(exc))
            return redirect("model-page", name=name)
        messages.success(request, f"Model {name} deleted.")
        return redirect("registry")
    return redirect("model-page", name=name)
