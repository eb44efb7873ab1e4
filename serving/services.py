"""State changes of API keys."""

from __future__ import annotations

import hashlib
import secrets

from django.db import transaction
from django.utils import timezone

from serving.models import ApiKey

KEY_PREFIX = "fp-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@transaction.atomic
def create_api_key(name: str, scope: str) -> tuple[ApiKey, str]:
    """Create a key; returns the record and the key itself, which is shown only once."""
    if not name.strip():
        raise ValueError("a key needs a name")
    if scope not in ApiKey.Scope.values:
        raise ValueError(f"scope must be one of {', '.join(ApiKey.Scope.values)}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKey.objects.create(name=name.strip(), scope=scope, prefix=key[:10],
                                   key_hash=hash_key(key))
    return record, key


@transaction.atomic
def revoke_api_key(record: ApiKey) -> ApiKey:
    if record.revoked_at is None:
        record.revoked_at = timezone.now()
        record.save(update_fields=["revoked_at"])
    return record


def find_active_key(key: str) -> ApiKey | None:
    if not key.startswith(KEY_PREFIX):
        return None
    return ApiKey.objects.filter(key_hash=hash_key(key), revoked_at__isnull=True).first()
