"""State changes of API keys and teams; each one is recorded in the audit log."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from access import signals
from serving.models import ApiKey, Team

KEY_PREFIX = "fp-"


class KeyRequestError(ValueError):
    """A key or team request that cannot be carried out; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class TeamNameTaken(KeyRequestError):
    """Another team has that name (a conflict, not bad input)."""


# Limits are stored as 32-bit integers.
MAX_LIMIT = 2**31 - 1


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_summary(record: ApiKey) -> dict[str, Any]:
    """What the audit log keeps of a key (never its hash)."""
    return {"name": record.name, "prefix": record.prefix, "scope": record.scope,
            "team": record.team.name if record.team_id and record.team else None,
            "user": record.user.get_username() if record.user_id and record.user else None,
            "models": list(record.allowed_models or []), "priority": record.priority,
            "rpm": record.rpm_limit, "tpm": record.tpm_limit,
            "expires_at": record.expires_at.isoformat() if record.expires_at else None,
            "revoked_at": record.revoked_at.isoformat() if record.revoked_at else None}


def _limit(field: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise KeyRequestError(field, f"{field} must be a whole number from 1 to {MAX_LIMIT} "
                                     f"(or empty for no limit)")
    return value


@transaction.atomic
def create_api_key(name: str, scope: str, *, team: str | None = None,
                   user: str | None = None, models: Iterable[str] = (),
                   priority: str | None = None, rpm: int | None = None,
                   tpm: int | None = None, expires_at: datetime | None = None,
                   actor: str = "system") -> tuple[ApiKey, str]:
    """Create a key; returns the record and the key itself, which is shown only once."""
    from serving.priority import DEFAULT_CLASS, classes

    if not isinstance(name, str) or not name.strip():
        raise KeyRequestError("name", "a key needs a name")
    if len(name.strip()) > 100:
        raise KeyRequestError("name", "a key's name is at most 100 characters")
    if scope not in ApiKey.Scope.values:
        raise KeyRequestError("scope", f"scope must be one of {', '.join(ApiKey.Scope.values)}")
    priority = priority or DEFAULT_CLASS
    if priority not in classes():
        raise KeyRequestError("priority", f"unknown priority class {priority!r}: one of "
                                    f"{', '.join(classes())}")
    allowed = [m.strip() for m in models if isinstance(m, str) and m.strip()]
    if len(allowed) != len(list(models)):
        raise KeyRequestError("models", "models must be a list of model or deployment names")
    team_record = None
    if team:
        team_record = Team.objects.filter(name=team).first()
        if team_record is None:
            raise KeyRequestError("team", f"no team named {team!r}")
    user_record = None
    if user:
        user_record = get_user_model().objects.filter(username=user).first()
        if user_record is None:
            raise KeyRequestError("user", f"no user named {user!r}")
    if expires_at is not None and expires_at <= timezone.now():
        raise KeyRequestError("expires_at", "the expiry must be in the future")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKey.objects.create(
        name=name.strip(), scope=scope, prefix=key[:10], key_hash=hash_key(key),
        team=team_record, user=user_record, allowed_models=allowed, priority=priority,
        rpm_limit=_limit("rpm", rpm), tpm_limit=_limit("tpm", tpm), expires_at=expires_at)
    signals.record(actor, "key-created", f"API key {record.name} ({record.prefix}…) created",
                   after=key_summary(record))
    return record, key


@transaction.atomic
def revoke_api_key(record: ApiKey, *, actor: str = "system") -> ApiKey:
    if record.revoked_at is None:
        before = key_summary(record)
        record.revoked_at = timezone.now()
        record.save(update_fields=["revoked_at"])
        signals.record(actor, "key-revoked", f"API key {record.name} ({record.prefix}…) revoked",
                       before=before, after=key_summary(record))
    return record


@transaction.atomic
def create_team(name: str, *, rpm: int | None = None, tpm: int | None = None,
                actor: str = "system") -> Team:
    if not isinstance(name, str) or not name.strip() or len(name.strip()) > 100:
        raise KeyRequestError("name", "a team needs a name of at most 100 characters")
    if Team.objects.filter(name=name.strip()).exists():
        raise TeamNameTaken("name", f"a team named {name.strip()!r} already exists")
    team = Team.objects.create(name=name.strip(), rpm_limit=_limit("rpm", rpm),
                               tpm_limit=_limit("tpm", tpm))
    signals.record(actor, "team-created", f"team {team.name} created",
                   after={"name": team.name, "rpm": team.rpm_limit, "tpm": team.tpm_limit})
    return team


@transaction.atomic
def update_team(team: Team, *, actor: str = "system", **limits: Any) -> Team:
    before = {"name": team.name, "rpm": team.rpm_limit, "tpm": team.tpm_limit}
    for field in ("rpm", "tpm"):
        if field in limits:
            setattr(team, f"{field}_limit", _limit(field, limits[field]))
    team.save()
    signals.record(actor, "team-changed", f"team {team.name} changed", before=before,
                   after={"name": team.name, "rpm": team.rpm_limit, "tpm": team.tpm_limit})
    return team


def find_active_key(key: str) -> ApiKey | None:
    if not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    record = ApiKey.objects.filter(key_hash=hash_key(key), revoked_at__isnull=True).first()
    return record if record is not None and record.is_active() else None
