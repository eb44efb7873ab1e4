"""Engine keys: the bearer token each deployment's replicas demand, and the sealing that
keeps it unreadable at rest (the database row, the route table in Redis).

Sealing is Fernet (AES-128-CBC with HMAC-SHA256) under a key derived from SECRET_KEY with
HKDF, so every process of one install (controllers, gateways) can open what another sealed,
and nothing else can. SECRET_KEY_FALLBACKS are tried when opening, so a rotated SECRET_KEY
keeps the keys sealed under the old one readable until they are sealed again.
"""

from __future__ import annotations

import base64
import functools
import secrets

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

# Distinct from every other use of SECRET_KEY (sessions, signing): a derived key never
# equals one Django derives.
_INFO = b"fleetplane engine keys v1"


class SealError(ValueError):
    """A sealed value could not be opened (another install's, or corrupted)."""


def new_engine_key() -> str:
    """256 random bits, URL-safe text (what vLLM's --api-key and a Bearer header take)."""
    return secrets.token_urlsafe(32)


def _fernet_key(secret: str) -> bytes:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(
        secret.encode())
    return base64.urlsafe_b64encode(derived)


@functools.lru_cache(maxsize=8)
def _box(secret: str, fallbacks: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(_fernet_key(s)) for s in (secret, *fallbacks)])


def _current() -> MultiFernet:
    return _box(str(settings.SECRET_KEY),
                tuple(str(s) for s in getattr(settings, "SECRET_KEY_FALLBACKS", ())))


def seal(text: str) -> str:
    """`text` encrypted and authenticated under this install's key; "" stays ""."""
    if not text:
        return ""
    return _current().encrypt(text.encode()).decode()


def unseal(token: str) -> str:
    """What `seal` sealed; raises SealError for a token this install did not make."""
    if not token:
        return ""
    try:
        return _current().decrypt(token.encode()).decode()
    except (InvalidToken, ValueError):
        raise SealError("a sealed value could not be opened with this install's "
                        "SECRET_KEY (or SECRET_KEY_FALLBACKS)") from None
