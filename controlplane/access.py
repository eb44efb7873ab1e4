"""Admin pages for access: API keys (created with the secret shown once, revoked), teams
and their budgets, users and their roles. Everything here is audited (the services do it)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_POST

from access.listing import filtered_page, page_of
from access.roles import ROLES, UserExists, create_user, role_of, role_required, set_role
from controlplane import filters
from controlplane.forms import suggesting
from serving import services
from serving.models import ApiKey, Team
from serving.priority import DEFAULT_CLASS, classes


def _limit(required: bool = False) -> forms.IntegerField:
    return forms.IntegerField(min_value=1, required=required, help_text="per minute; empty: none")


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    scope = forms.ChoiceField(choices=ApiKey.Scope.choices, initial=ApiKey.Scope.INFERENCE)
    team = forms.CharField(max_length=100, required=False, help_text="a team's name; empty: "
                           "none", widget=suggesting("team-names",
                                                     "/api/v1/teams/?limit=10&search="))
    models = forms.CharField(required=False, help_text="comma-separated; empty: all")
    priority = forms.ChoiceField(choices=[], initial=DEFAULT_CLASS)
    rpm = _limit()
    tpm = _limit()
    expires_days = forms.IntegerField(label="Expires in (days)", min_value=1, max_value=3650,
                                      required=False,
                                      help_text="days; empty: never")

    def clean_team(self) -> Team | None:
        name = (self.cleaned_data.get("team") or "").strip()
        if not name:
            return None
        team = Team.objects.filter(name=name).first()
        if team is None:
            raise forms.ValidationError(f"no team named {name!r}")
        return team

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["priority"].choices = [  # type: ignore[attr-defined]
            (name, f"{name} ({c.level})") for name, c in classes().items()]


class TeamForm(forms.Form):
    name = forms.CharField(max_length=100)
    rpm = _limit()
    tpm = _limit()


class UserForm(forms.Form):
    username = forms.RegexField(r"^[\w.@+-]{1,150}$", max_length=150)
    role = forms.ChoiceField(choices=[(r, r) for r in ROLES], initial="viewer")


def actor(request: HttpRequest) -> str:
    return request.user.get_username()


@role_required("admin")
def keys_page(request: HttpRequest) -> HttpResponse:
    key_form = KeyForm(request.POST if request.POST.get("form") == "key" else None)
    team_form = TeamForm(request.POST if request.POST.get("form") == "team" else None)
    # Shown once: kept in the session across the redirect after the form, then dropped.
    secret = request.session.pop("new_key", None) if request.method == "GET" else None
    if request.method == "POST" and key_form.is_bound and key_form.is_valid():
        data = key_form.cleaned_data
        try:
            record, secret = services.create_api_key(
                data["name"], data["scope"], team=data["team"].name if data["team"] else None,
                models=[m for m in data["models"].split(",") if m.strip()],
                priority=data["priority"], rpm=data["rpm"], tpm=data["tpm"],
                expires_at=timezone.now() + timedelta(days=data["expires_days"])
                if data["expires_days"] else None, actor=actor(request))
        except services.KeyRequestError as exc:
            key_form.add_error(None, f"{exc.field}: {exc}")
        else:
            messages.success(request, f"Key {record.name} created.")
            request.session["new_key"] = secret
            return redirect("keys")
    if request.method == "POST" and team_form.is_bound and team_form.is_valid():
        data = team_form.cleaned_data
        try:
            team = services.create_team(data["name"], rpm=data["rpm"], tpm=data["tpm"],
                                        actor=actor(request))
        except services.KeyRequestError as exc:
            team_form.add_error(None, f"{exc.field}: {exc}")
        else:
            messages.success(request, f"Team {team.name} created.")
            return redirect("keys")
    keys, given, error = filtered_page(request, ApiKey.objects.select_related("team", "user"),
                                       filters.KEYS)
    return render(request, "controlplane/keys.html", {
        "keys": keys, "given": given, "filtered": bool(given), "filter_error": error,
        "scopes": ApiKey.Scope.choices, "states": list(filters.KEY_STATES),
        "teams": page_of(request, Team.objects.all(), param="teams_page"),
        "key_form": key_form, "team_form": team_form, "secret": secret},
        status=400 if error else 200)


@role_required("admin")
@require_POST
def revoke_key(request: HttpRequest, pk: int) -> HttpResponse:
    record = get_object_or_404(ApiKey, pk=pk)
    services.revoke_api_key(record, actor=actor(request))
    messages.success(request, f"Key {record.name} ({record.prefix}…) revoked.")
    return redirect("keys")


@role_required("admin")
def users_page(request: HttpRequest) -> HttpResponse:
    form = UserForm(request.POST or None)
    created = request.session.pop("new_user", None) if request.method == "GET" else None
    if request.method == "POST" and form.is_valid():
        name = form.cleaned_data["username"]
        try:
            _, password = create_user(name, form.cleaned_data["role"], actor=actor(request))
        except UserExists as exc:
            form.add_error("username", str(exc))
        else:
            messages.success(request, f"User {name} created.")
            request.session["new_user"] = [name, password]
            return redirect("users")
    rows = [(user, role_of(user)) for user in
            get_user_model().objects.prefetch_related("groups").order_by("username")]
    return render(request, "controlplane/users.html", {
        "rows": rows, "form": form, "roles": ROLES,
        "new_user": created[0] if created else None,
        "password": created[1] if created else None})


@role_required("admin")
@require_POST
def change_role(request: HttpRequest, username: str) -> HttpResponse:
    user = get_object_or_404(get_user_model(), username=username)
    role = request.POST.get("role", "")
    if user.is_superuser:
        messages.error(request, f"{username} is a superuser: always an admin.")
    elif role not in (*ROLES, "none"):
        messages.error(request, f"unknown role {role!r}")
    else:
        set_role(user, None if role == "none" else role, actor=actor(request))
        messages.success(request, f"{username} is now {role}.")
    return redirect("users")


urlpatterns = [
    path("keys/", keys_page, name="keys"),
    path("keys/<int:pk>/revoke/", revoke_key, name="key-revoke"),
    path("users/", users_page, name="users"),
    path("users/<str:username>/role/", change_role, name="user-role"),
]
