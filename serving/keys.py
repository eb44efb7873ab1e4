"""API keys on the hot path: an in-memory cache in front of the database.

A key is looked up once, then served from memory. Any change to a key (create, revoke,
delete) clears this process's cache at once; other processes re-read a cached entry after
KEY_CACHE_SECONDS at most.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.signals import post_delete, post_save

from serving.models import ApiKey


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    name: str
    scope: str
    allowed_models: tuple[str, ...]

    def allows(self, *names: str) -> bool:
        return not self.allowed_models or any(n in self.allowed_models for n in names)


_cache: dict[str, tuple[KeyInfo | None, float]] = {}


def clear_cache(**kwargs: object) -> None:
    _cache.clear()


post_save.connect(clear_cache, sender=ApiKey, dispatch_uid="serving.keys.save")
post_delete.connect(clear_cache, sender=ApiKey, dispatch_uid="serving.keys.delete")


def _lookup(key_hash: str) -> KeyInfo | None:
    record = ApiKey.objects.filter(key_hash=key_hash, revoked_at__isnull=True).first()
    if record is None:
        return None
    return KeyInfo(record.pk, record.name, record.scope, tuple(record.allowed_models or ()))


async def authenticate(key: str) -> KeyInfo | None:
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    cached = _cache.get(key_hash)
    now = time.monotonic()
    if cached is not None and cached[1] > now:
        return cached[0]
    info = await sync_to_async(_lookup, thread_sensitive=False)(key_hash)
    # Unknown keys are remembered briefly too, so a client retrying a bad key cannot make
    # every request a database query.
    _cache[key_hash] = (info, now + settings.KEY_CACHE_SECONDS)
    if len(_cache) > 100_000:
        _cache.clear()
    return info
