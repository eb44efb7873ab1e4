"""API keys on the hot path: an in-memory cache in front of the database.

A key is looked up once, then served from memory for at most KEY_CACHE_SECONDS: past half
of that it is refreshed in the background, past all of it the entry is a miss and the
request waits for the database, so a revoked key is refused by every gateway process within
KEY_CACHE_SECONDS even without Redis. Any change to a key or team clears this process's
cache when its transaction commits (not before: a lookup between the change and the commit
would cache the old row) and, with REDIS_URL set, every other gateway process's within
GATEWAY_LOAD_SCRAPE_SECONDS. A lookup that was in flight across a clear answers its waiters
but is not cached, and a request after the clear does not join it. Concurrent requests
with an unseen key share one lookup. Unknown keys are remembered apart from known ones, so
a flood of made-up keys cannot push the real ones out of the cache. While the database
cannot be reached, keys known valid keep working from the cache (nothing newer can be read
about them) and others raise KeysUnavailable (the gateway answers 503).
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

from serving.hot_settings import hot
from serving.models import ApiKey, Team

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyInfo:
    """What the gateway knows of a key, cached."""

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
    key_hash: str = ""  # to look the key up again (running answers of a revoked key end)

    def expired(self) -> bool:
        """Whether the key's expiry has passed."""
        return self.expires is not None and time.time() >= self.expires

    def allows(self, *names: str) -> bool:
        """Whether the key may use any of these model names."""
        return not self.allowed_models or any(n in self.allowed_models for n in names)


# key hash -> (what the database said, when it said it); known keys and unknown ones apart
_cache: dict[str, tuple[KeyInfo | None, float]] = {}
_unknown: dict[str, tuple[KeyInfo | None, float]] = {}
CACHE_LIMIT = 100_000
UNKNOWN_LIMIT = 10_000
# key hash -> the lookup in flight and the cache generation it started in, shared by every
# request that needs it meanwhile (in the same generation: after a clear, a new lookup)
_lookups: dict[str, tuple[asyncio.Future[KeyInfo | None], int]] = {}
# Bumped by every clear: a lookup that started before it does not fill the cache.
_generation = [0]


KEYS_VERSION_KEY = "fleetplane:keys-version"
_seen_version: list[bytes | str | None] = [None]


def clear_cache(**kwargs: object) -> None:
    """A key or team changed: once the change commits, forget every cached key here and
    tell other gateway processes through Redis (they check every
    GATEWAY_LOAD_SCRAPE_SECONDS)."""
    from django.db import transaction

    transaction.on_commit(forget_all)


def forget_all() -> None:
    """Forget every cached key here (and tell other processes through Redis)."""
    forget_cached_keys()
    if settings.REDIS_URL:
        _bump_version()


def forget_cached_keys() -> None:
    """Forget every cached key of this process."""
    _generation[0] += 1
    _cache.clear()
    _unknown.clear()


# A change this process could not tell (Redis was away): told by its watcher once Redis
# answers again.
_untold = [False]


def _bump_version() -> None:
    from serving.redis_clients import shared

    try:
        shared(str(settings.REDIS_URL)).incr(KEYS_VERSION_KEY)
    except Exception as exc:
        _untold[0] = True
        logger.warning("could not tell other gateways that a key changed (%s); they "
                       "learn it when Redis answers again, or within KEY_CACHE_SECONDS", exc)


async def follow_key_changes(connection: Any, *also: str) -> list[Any]:
    """Clear the cache when another process changed a key (REDIS_URL set), and tell a
    change of this process that Redis could not take when it was made. Returns the values
    of the keys `also` names, read in the same round trip."""
    if _untold[0]:
        await connection.incr(KEYS_VERSION_KEY)
        _untold[0] = False
    version, *values = await connection.mget(KEYS_VERSION_KEY, *also)
    if version != _seen_version[0]:
        if _seen_version[0] is not None or version is not None:
            forget_cached_keys()
        _seen_version[0] = version
    return values


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
                   expires=record.expires_at.timestamp() if record.expires_at else None,
                   key_hash=key_hash)


def knows_valid_keys() -> bool:
    """Whether this process holds a valid key in its cache (one it can serve while the
    database is away)."""
    return bool(_cache)


class KeysUnavailable(Exception):
    """The database could not be asked about a key no cache entry vouches for."""


async def _fetch(key_hash: str) -> KeyInfo | None:
    """One database lookup per key at a time, however many requests wait for it. A
    request that comes after a clear does not join a lookup that began before it: that
    one may have read the row as it was before the change."""
    generation = _generation[0]
    pending = _lookups.get(key_hash)
    if pending is not None and pending[1] == generation:
        return await pending[0]
    future: asyncio.Future[KeyInfo | None] = asyncio.get_running_loop().create_future()
    entry = (future, generation)
    _lookups[key_hash] = entry
    try:
        info = await sync_to_async(_lookup, thread_sensitive=False)(key_hash)
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved here, so an unawaited future logs nothing
        raise
    finally:
        if _lookups.get(key_hash) is entry:
            del _lookups[key_hash]
    if generation == _generation[0]:  # nothing changed while the database answered
        store, limit = (_cache, CACHE_LIMIT) if info is not None else (_unknown, UNKNOWN_LIMIT)
        _cache.pop(key_hash, None)
        _unknown.pop(key_hash, None)
        while len(store) >= limit:  # the oldest entry goes first
            del store[next(iter(store))]
        store[key_hash] = (info, time.monotonic())
    future.set_result(info)
    return info


async def authenticate(key: str) -> KeyInfo | None:
    """The key's record if it is known, not revoked and not expired; None for every other
    case alike (the caller answers all of them the same way)."""
    return await authenticate_hash(hashlib.sha256(key.encode()).hexdigest())


async def authenticate_hash(key_hash: str) -> KeyInfo | None:
    """As `authenticate`, for a key known by its hash."""
    info = await _authenticate(key_hash)
    return None if info is None or info.expired() else info


async def _authenticate(key_hash: str) -> KeyInfo | None:
    from django.db import Error as DatabaseError

    cached = _cache.get(key_hash) or _unknown.get(key_hash)
    try:
        return await _cached_or_fetched(key_hash, cached)
    except DatabaseError as exc:
        if cached is not None and cached[0] is not None:
            # The database is away: a key known valid keeps working (nothing newer can
            # be read about it anyway); unknown keys cannot be checked.
            logger.warning("API keys cannot be read from the database (%s); serving a "
                           "known key from the cache", exc)
            return cached[0]
        raise KeysUnavailable(str(exc)) from exc


async def _cached_or_fetched(key_hash: str, cached: tuple[KeyInfo | None, float] | None
                             ) -> KeyInfo | None:
    if cached is not None:
        info, fetched = cached
        age = time.monotonic() - fetched
        ttl = hot.KEY_CACHE_SECONDS
        if age <= ttl:
            if age > ttl / 2 and key_hash not in _lookups:
                # Refresh ahead, in the background: a key in use never waits for the
                # database as long as it is used at least once per half-life.
                task = asyncio.get_running_loop().create_task(_fetch(key_hash))
                _background.add(task)
                task.add_done_callback(_finished)
            return info
    # Unseen, or older than KEY_CACHE_SECONDS: never answered from a stale entry.
    return await _fetch(key_hash)


_background: set[asyncio.Task[KeyInfo | None]] = set()


def _finished(task: asyncio.Task[KeyInfo | None]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not refresh a cached API key: %s", task.exception())
