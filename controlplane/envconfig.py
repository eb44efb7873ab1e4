"""Strict readers for settings taken from environment variables.

A bad value stops start-up with a message that names the variable, instead of
being silently read as a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured


class SettingError(ImproperlyConfigured):
    """An environment variable holds a value the project cannot use."""


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str = "") -> str:
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in {"true", "1", "yes", "on"}:
        return True
    if lowered in {"false", "0", "no", "off"}:
        return False
    raise SettingError(f"{name}={value!r} is not a boolean: use true or false")


def env_int(name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise SettingError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise SettingError(f"{name}={number} is below the minimum of {minimum}")
    if maximum is not None and number > maximum:
        raise SettingError(f"{name}={number} is above the maximum of {maximum}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None,
              maximum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise SettingError(f"{name}={value!r} is not a number") from None
    if minimum is not None and number < minimum:
        raise SettingError(f"{name}={number:g} is below the minimum of {minimum:g}")
    if maximum is not None and number > maximum:
        raise SettingError(f"{name}={number:g} is above the maximum of {maximum:g}")
    return number


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default or [])
    return [item.strip() for item in value.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise SettingError(f"{name}={value!r} is not one of: {', '.join(choices)}")
    return value


def env_path(name: str, default: Path) -> Path:
    value = _raw(name)
    return default if value is None else Path(value).expanduser().resolve()


def database_from_url(name: str, url: str) -> dict[str, object]:
    """Turn DATABASE_URL (postgres://user:pass@host:port/db or sqlite:///path) into
    Django's DATABASES entry."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in {"postgres", "postgresql", "pgsql"}:
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise SettingError(f"{name}={url!r} names no database (postgres://host/DBNAME)")
        try:
            port = parts.port
        except ValueError:
            raise SettingError(f"{name}={url!r} has a bad port") from None
        options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    if scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc:
            raise SettingError(f"{name}={url!r}: write sqlite:///relative or sqlite:////absolute")
        if not path or path == "/":
            raise SettingError(f"{name}={url!r} names no database file")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path.lstrip("/") if
                not path.startswith("//") else path[1:],
                # As PostgreSQL's: a thread keeps its connection between passes.
                "CONN_MAX_AGE": 60}
    raise SettingError(
        f"{name}={url!r}: unsupported scheme {scheme!r} (use postgres:// or sqlite:///)"
    )


def redis_url(name: str) -> str | None:
    value = _raw(name)
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise SettingError(f"{name}={value!r}: use redis://host:port/db")
    return value


def env_absolute_paths(name: str, default: list[str] | None = None) -> list[str]:
    """A comma-separated list of absolute paths, normalised (no `..`, no trailing /)."""
    paths = env_list(name, default)
    for path in paths:
        if not path.startswith("/") or ".." in path.split("/"):
            raise SettingError(f"{name}: {path!r} is not an absolute path without `..`")
    return [os.path.normpath(path) for path in paths]


def env_labels(name: str, default: dict[str, str] | None = None) -> dict[str, str]:
    """Kubernetes labels as `key=value,key=value`; empty gives the default."""
    value = _raw(name)
    if value is None:
        return dict(default or {})
    labels = {}
    for item in value.split(","):
        key, sep, label = item.strip().partition("=")
        if not sep or not key.strip():
            raise SettingError(f"{name}: {item.strip()!r} is not key=value")
        labels[key.strip()] = label.strip()
    return labels
