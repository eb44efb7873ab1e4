"""API keys on the hot path: an in-memory cache in front of the database.

A key is looked up once, then served from memory. Any change to a key (create, revoke,
delete) clears this process's cache at once and, with REDIS_URL set, every other gateway
process's within GATEWAY_LOAD_SCRAPE_SECONDS. Besides, an entry older than
KEY_CACHE_SECONDS is refreshed in the background. Concurrent requests with an unseen key
share one lookup; no request waits for the database once its key has been seen.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models.signals import post_delete, post_save

from serving.models import ApiKey, Team

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    name: str
    scope: str
    allowed_models: tuple[str, ...]
    priority: str = "standard"  # the highest class the key may use
    rpm: int | None = None
    tpm: int | None = None
    team_id: int | None = None
    team_rpm: int | None = None
    team_tpm: int | None = None
    expires: float | None = None  # seconds since the epoch

    def expired(self) -> bool:
        return self.expires is not None and time.time() >= self.expires

    def allows(self, *names: str) -> bool:
        return not self.allowed_models or any(n in self.allowed_models for n in names)


# key hash -> (what the database said, when it said it)
_cache: dict[str, tuple[KeyInfo | None, float]] = {}
# key hash -> the lookup in flight, shared by every request that needs it meanwhile
_lookups: dict[str, asyncio.Future[KeyInfo | None]] = {}


KEYS_VERSION_KEY = "fleetplane:keys-version"
_seen_version: list[bytes | str | None] = [None]


def clear_cache(**kwargs: object) -> None:
    """A key changed: forget every cached key here, and tell other gateway processes
    through Redis (they check every GATEWAY_LOAD_SCRAPE_SECONDS)."""
    _cache.clear()
    if settings.REDIS_URL:
        from django.db import transaction

        transaction.on_commit(_bump_version)


def _bump_version() -> None:
    import redis

    try:
        redis.Redis.from_url(str(settings.REDIS_URL)).incr(KEYS_VERSION_KEY)
    except Exception:
        logger.exception("could not tell other gateways that a key changed")


async def follow_key_changes(connection: Any) -> None:
    """Clear the cache when another process changed a key (REDIS_URL set)."""
    version = await connection.get(KEYS_VERSION_KEY)
    if version != _seen_version[0]:
        if _seen_version[0] is not None or version is not None:
            _cache.clear()
        _seen_version[0] = version


post_save.connect(clear_cache, sender=ApiKey, dispatch_uid="serving.keys.save")
post_delete.connect(clear_cache, sender=ApiKey, dispatch_uid="serving.keys.delete")
post_save.connect(clear_cache, sender=Team, dispatch_uid="serving.keys.team-save")
post_delete.connect(clear_cache, sender=Team, dispatch_uid="serving.keys.team-delete")


def _lookup(key_hash: str) -> KeyInfo | None:
    record = (ApiKey.objects.filter(key_hash=key_hash, revoked_at__isnull=True)
              .select_related("team").first())
    if record is None:
        return None
    team = record.team
    return KeyInfo(record.pk, record.name, record.scope, tuple(record.allowed_models or ()),
                   priority=record.priority, rpm=record.rpm_limit, tpm=record.tpm_limit,
                   team_id=team.pk if team else None,
                   team_rpm=team.rpm_limit if team else None,
                   team_tpm=team.tpm_limit if team else None,
                   expires=record.expires_at.timestamp() if record.expires_at else None)


async def _fetch(key_hash: str) -> KeyInfo | None:
    """One database lookup per key at a time, however many requests wait for it."""
    pending = _lookups.get(key_hash)
    if pending is not None:
        return await pending
    future: asyncio.Future[KeyInfo | None] = asyncio.get_running_loop().create_future()
    _lookups[key_hash] = future
    try:
        info = await sync_to_async(_lookup, thread_sensitive=False)(key_hash)
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved here, so an unawaited future logs nothing
        raise
    finally:
        _lookups.pop(key_hash, None)
    if len(_cache) > 100_000:
        _cache.clear()
    _cache[key_hash] = (info, time.monotonic())
    future.set_result(info)
    return info


async def authenticate(key: str) -> KeyInfo | None:
    """The key's record if it is known, not revoked and not expired; None for every other
    case alike (the caller answers all of them the same way)."""
    info = await _authenticate(key)
    return None if info is None or info.expired() else info


async def _authenticate(key: str) -> KeyInfo | None:
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    cached = _cache.get(key_hash)
    if cached is None:
        # Unknown keys are remembered too, so retrying a bad key cannot make every
        # request a database query.
        return await _fetch(key_hash)
    info, fetched = cached
    if time.monotonic() - fetched > settings.KEY_CACHE_SECONDS and key_hash not in _lookups:
        # Serve what is known and refresh in the background: no request waits for the
        # database once its key has been seen.
        task = asyncio.get_running_loop().create_task(_fetch(key_hash))
        _background.add(task)
        task.add_done_callback(_background.discard)
    return info


_background: set[asyncio.Task[KeyInfo | None]] = set()
