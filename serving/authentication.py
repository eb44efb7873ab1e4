"""REST API authentication: `Authorization: Bearer <key>` for automation, the session for
the browser. Admin endpoints need an admin-scope key or a staff user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from serving.models import ApiKey
from serving.services import find_active_key

if TYPE_CHECKING:  # rest_framework.views imports this module through the API settings
    from rest_framework.views import APIView


@dataclass(frozen=True)
class ApiKeyPrincipal:
    """The caller behind an API key, in the place DRF keeps `request.user`."""

    key: ApiKey

    is_authenticated = True
    is_anonymous = False

    @property
    def is_staff(self) -> bool:
        return self.key.allows_admin()

    @property
    def username(self) -> str:
        return f"key:{self.key.name}"

    def __str__(self) -> str:
        return self.username


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[ApiKeyPrincipal, ApiKey] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, key = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        key = key.strip()
        if not key:
            raise exceptions.AuthenticationFailed("Authorization: Bearer needs a key")
        record = find_active_key(key)
        if record is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return ApiKeyPrincipal(record), record

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class IsAdmin(permissions.BasePermission):
    message = "this endpoint needs an admin-scope API key or a staff login"

    def has_permission(self, request: Request, view: APIView) -> bool:
        user = request.user
        return bool(user is not None and user.is_authenticated and user.is_staff)
