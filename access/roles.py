"""Roles: viewer (dashboards, read-only lists), operator (deploy, scale, the playground),
admin (keys, teams, users, backends, the audit log).

A user's role is the Django group of that name; superusers and staff users are admins
(setting the admin role makes a user staff, so the admin site opens to them too). An API
key with the admin scope acts as an admin; inference keys reach only the gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from rest_framework import permissions

if TYPE_CHECKING:  # rest_framework.views imports this module through the API settings
    from rest_framework.request import Request
    from rest_framework.views import APIView

ROLES = ("viewer", "operator", "admin")
# A user's role as the API gives and takes it ("none": no role).
USER_ROLE_CHOICES = (*ROLES, "none")


def role_of(user: Any) -> str | None:
    """The user's role, or None (no access beyond logging in)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    key = getattr(user, "key", None)
    if key is not None:  # an API key (serving.authentication.ApiKeyPrincipal)
        return "admin" if user.is_staff else None
    if not user.is_active:
        return None
    if user.is_superuser or user.is_staff:
        return "admin"
    if hasattr(user, "_fleetplane_role"):
        cached: str | None = user._fleetplane_role
        return cached
    names = set(user.groups.filter(name__in=ROLES).values_list("name", flat=True))
    role = next((r for r in reversed(ROLES) if r in names), None)
    user._fleetplane_role = role
    return role


def context(request: HttpRequest) -> dict[str, Any]:
    """`role` in every template: the navigation shows what the user may open."""
    user = getattr(request, "user", None)
    return {"role": role_of(user) if user is not None else None}


def has_role(user: Any, needed: str) -> bool:
    role = role_of(user)
    return role is not None and ROLES.index(role) >= ROLES.index(needed)


def role_required(needed: str) -> Callable[[Callable[..., HttpResponse]],
                                           Callable[..., HttpResponse]]:
    """For pages: the login page when not logged in, 403 without the role."""
    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path(), "login")
            if not has_role(request.user, needed):
                raise PermissionDenied(f"this page needs the {needed} role")
            return view(request, *args, **kwargs)

        return guarded

    return decorate


class RolePermission(permissions.BasePermission):
    """The REST API's check. Reading needs `view.read_role` (default viewer), changing
    `view.write_role` (default operator); `view.action_roles` names a role per action."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        needed = self.needed(request, view)
        if not has_role(request.user, needed):
            self.message = f"this endpoint needs the {needed} role" + (
                ": inference keys reach only the gateway; use an admin-scope API key"
                if getattr(request.user, "key", None) is not None else "")
            return False
        return True

    @staticmethod
    def needed(request: Request, view: APIView) -> str:
        action = getattr(view, "action", None)
        by_action: dict[str, str] = getattr(view, "action_roles", {})
        if action in by_action:
            return by_action[action]
        if request.method in permissions.SAFE_METHODS:
            return str(getattr(view, "read_role", "viewer"))
        return str(getattr(view, "write_role", "operator"))


class UserExists(ValueError):
    pass


@transaction.atomic
def create_user(username: str, role: str | None, *, actor: str, password: str = "",
                is_active: bool = True) -> tuple[Any, str]:
    """A new user with one role, recorded in the audit log; returns the user and the
    password (made here when none is given: the caller shows it once)."""
    import secrets

    from django.contrib.auth import get_user_model

    from access.signals import record

    users = get_user_model()
    if users.objects.filter(username=username).exists():
        raise UserExists(f"a user named {username!r} already exists")
    password = password or secrets.token_urlsafe(12)
    user = users.objects.create_user(username, password=password, is_active=is_active)
    record(actor, "user-created", f"user {username} created",
           after={"username": username, "is_active": is_active})
    set_role(user, role, actor=actor)
    return user, password


def actor_of(request: Any) -> str:
    """Who made a request, as the audit log names them: a user name or `key:<name>`."""
    user = request.user
    return str(getattr(user, "username", None) or getattr(user, "get_username", lambda: "")())


@transaction.atomic
def set_role(user: Any, role: str | None, *, actor: str) -> None:
    """Give a user one role (or none), recorded in the audit log."""
    from django.contrib.auth.models import Group

    from access.signals import record

    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)} (or none)")
    before = {"role": role_of(user), "is_staff": user.is_staff}
    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    if role is not None:
        group, _ = Group.objects.get_or_create(name=role)
        user.groups.add(group)
    if not user.is_superuser:
        user.is_staff = role == "admin"
        user.save(update_fields=["is_staff"])
    if hasattr(user, "_fleetplane_role"):
        del user._fleetplane_role
    record(actor, "user-role-changed", f"user {user.get_username()}: role "
                                       f"{before['role'] or 'none'} -> {role or 'none'}",
           before=before, after={"role": role, "is_staff": user.is_staff})
