"""Secrets are never shown back: redaction for the API, the pages and the audit log.

A value is secret when its name looks like one (key, token, secret, password, auth,
credential), when it is a value of an `env` map, or when it is the password of a URL
(`https://user:pass@host`) or a secret-named query parameter (`?token=...`). Strings are
searched wherever they are, so a message quoting such a URL is redacted too.

`keep_redacted` is the other half: a client that reads a redacted config and sends it back
unchanged must not overwrite the stored secret with the mask.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# "tokenizer" (a model's, e.g. --tokenizer-mode) and "tokens" (counts) are no secrets.
SECRET_NAME = re.compile(r"key|token(?!izer|s)|secret|passw|pwd|auth|credential|cookie|"
                         r"signature", re.IGNORECASE)
# Settings that name a Kubernetes Secret rather than hold one: the name is no secret and
# an operator needs to see which Secret a backend uses.
SECRET_REFERENCES = frozenset({"hf_token_secret", "image_pull_secrets"})
# Fields of API records whose names look secret but hold none (a key's public prefix).
PUBLIC_FIELDS = frozenset({"prefix", "keys", "kv_cache_gib", "kv_cache_dtype"})

URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
SECRET_FLAG = re.compile(r"^--?[\w-]*(" + SECRET_NAME.pattern + r")[\w-]*$", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return (name not in SECRET_REFERENCES and name not in PUBLIC_FIELDS
            and bool(SECRET_NAME.search(name)))


def redact_url(url: str) -> str:
    """`scheme://user:***@host/path?token=***`: the password and secret-named query
    parameters masked, the rest kept so the endpoint can still be recognised."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(name) for name, _ in pairs):
            query = urlencode([(name, MASK if is_secret_name(name) and value else value)
                               for name, value in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URL inside a piece of text, redacted."""
    if "://" not in text:
        return text
    return URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)


def _redact_args(items: list[Any]) -> list[Any]:
    """Command-line style lists: `--api-key X` and `--api-key=X` keep the flag only."""
    out: list[Any] = []
    hide_next = False
    for item in items:
        if hide_next and isinstance(item, str) and item:
            out.append(MASK)
            hide_next = False
            continue
        hide_next = False
        if isinstance(item, str) and item.startswith("-"):
            flag, equals, _value = item.partition("=")
            if SECRET_FLAG.match(flag):
                if equals:
                    out.append(f"{flag}={MASK}")
                    continue
                hide_next = True
        out.append(redact(item))
    return out


def _mask(value: Any) -> Any:
    # Empty and null values stay as they are: "no secret set" is worth seeing.
    return MASK if value not in (None, "", [], {}) else value


def _redact_env(env: Any) -> Any:
    if isinstance(env, dict):
        return {name: _mask(value) for name, value in env.items()}
    if isinstance(env, list):
        # The Kubernetes form: [{"name": ..., "value": ...}]; valueFrom is a reference.
        return [{**entry, "value": _mask(entry["value"])}
                if isinstance(entry, dict) and "value" in entry else redact(entry)
                for entry in env]
    return _mask(env)


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with every secret masked."""
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for name, item in value.items():
            if isinstance(name, str) and name.lower() in ("env", "environment", "headers"):
                out[name] = _redact_env(item)
            elif isinstance(name, str) and is_secret_name(name) and not isinstance(
                    item, dict | list | bool | int | float):
                out[name] = _mask(item)
            else:
                out[name] = redact(item)
        return out
    if isinstance(value, list | tuple):
        return _redact_args(list(value))
    if isinstance(value, str):
        return redact_text(value)
    return value


_UNSET: Any = object()


def keep_redacted(new: Any, old: Any, shown: Any = _UNSET) -> Any:
    """`new`, except where it holds exactly what the client was shown of `old` (the masked
    form): there the stored value is kept, so a round trip never stores the mask."""
    if shown is _UNSET:
        shown = redact(old)
    if new == shown and shown != old:
        return old
    if isinstance(new, dict) and isinstance(old, dict) and isinstance(shown, dict):
        return {name: keep_redacted(item, old[name], shown.get(name)) if name in old else item
                for name, item in new.items()}
    if (isinstance(new, list) and isinstance(old, list) and isinstance(shown, list)
            and len(new) == len(old) == len(shown)):
        return [keep_redacted(item, old[i], shown[i]) for i, item in enumerate(new)]
    if isinstance(new, str) and isinstance(old, str) and MASK in new and "://" in new:
        return _unmask_url(new, old)
    return new


def _unmask_url(new: str, old: str) -> str:
    """A URL edited from its masked form (another host, the same user): the masked password
    and query values are the stored ones."""
    try:
        new_parts, old_parts = urlsplit(new), urlsplit(old)
    except ValueError:
        return new
    netloc = new_parts.netloc
    if new_parts.password == MASK and old_parts.password is not None:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{old_parts.password}@{host}"
    query = new_parts.query
    if MASK in query:
        stored = dict(parse_qsl(old_parts.query, keep_blank_values=True))
        query = urlencode([(name, stored.get(name, value) if value == MASK else value)
                           for name, value in parse_qsl(query, keep_blank_values=True)])
    return urlunsplit((new_parts.scheme, netloc, new_parts.path, query, new_parts.fragment))
