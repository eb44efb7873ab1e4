"""State changes of the control plane itself."""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.db import transaction

LOCAL_ADMIN_USERNAME = "admin"


@transaction.atomic
def ensure_local_admin() -> tuple[str, str | None]:
    """Make sure someone can log in. Creates the local admin on first start with a
    generated password, returned once (only its hash is stored). Returns the username and
    the password, or None for the password when an administrator already existed."""
    users = get_user_model()
    existing = users.objects.filter(is_superuser=True, is_active=True).order_by("pk").first()
    if existing is not None:
        return existing.get_username(), None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(LOCAL_ADMIN_USERNAME, email="", password=password)
    return LOCAL_ADMIN_USERNAME, password
