"""REST API authentication: `Authorization: Bearer <key>` for automation, the session for
the browser. What each caller may do is controlplane/roles.py's: an admin-scope key acts
as an admin."""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import authentication, exceptions
from rest_framework.request import Request

from serving.models import ApiKey
from serving.services import find_active_key


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
            raise exceptions.AuthenticationFailed("invalid, expired or revoked API key")
        return ApiKeyPrincipal(record), record

    def authenticate_header(self, request: Request) -> str:
        return self.keyword
