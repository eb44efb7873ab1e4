"""Throttled logins, for the login page and the Django admin's.

Failed attempts are counted per username and per client address, in windows of a minute
that start at the first failure. At LOGIN_FAILURES_PER_MINUTE failures either count
refuses further attempts, without checking the password, until its window ends: a
password guesser gets a few tries a minute, whatever the password. A successful login
clears its username's count (not its address's: one valid account must not buy more
guesses at others). Counts live in Redis when REDIS_URL is set, so every process shares
them; else in this process. The address is REMOTE_ADDR: the connection's, or behind
TRUSTED_PROXIES the client address serving/proxies.py put into the ASGI scope.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from time import monotonic
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 60
REDIS_PREFIX = "fleetplane:login-failures:"


class LoginThrottle:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: dict[str, tuple[int, float]] = {}  # key -> (failures, window end)
        self.redis: Any = None
        self.redis_url = ""

    @staticmethod
    def keys(username: str, address: str) -> list[str]:
        # Hashed: a username is whatever the form was sent, of any length.
        name = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
        return [f"{REDIS_PREFIX}user:{name}", f"{REDIS_PREFIX}address:{address[:64]}"]

    def connection(self) -> Any:
        url = str(settings.REDIS_URL or "")
        if not url:
            return None
        if self.redis is None or self.redis_url != url:
            import redis

            self.redis = redis.Redis.from_url(url, socket_timeout=2)
            self.redis_url = url
        return self.redis

    def wait_seconds(self, username: str, address: str) -> int:
        """How long until attempts for this username and address are taken again; 0 now."""
        limit = settings.LOGIN_FAILURES_PER_MINUTE
        if not limit:
            return 0
        keys = self.keys(username, address)
        connection = self.connection()
        if connection is not None:
            try:
                with connection.pipeline() as pipe:
                    for key in keys:
                        pipe.get(key)
                        pipe.pttl(key)
                    found = pipe.execute()
                waits = [max(int(ttl), 0) / 1000 for count, ttl in zip(
                    found[::2], found[1::2], strict=True) if count and int(count) >= limit]
                return math.ceil(max(waits, default=0))
            except Exception:  # the store is away: count in this process meanwhile
                logger.exception("could not read failed logins from Redis")
        now = monotonic()
        with self.lock:
            waits = [end - now for count, end in (self.windows.get(key, (0, 0.0))
                                                  for key in keys)
                     if count >= limit and end > now]
        return math.ceil(max(waits, default=0))

    def failed(self, username: str, address: str) -> None:
        keys = self.keys(username, address)
        connection = self.connection()
        if connection is not None:
            try:
                with connection.pipeline() as pipe:
                    for key in keys:
                        pipe.incr(key)
                        pipe.expire(key, WINDOW_SECONDS, nx=True)
                    pipe.execute()
                return
            except Exception:
                logger.exception("could not count a failed login in Redis")
        now = monotonic()
        with self.lock:
            if len(self.windows) > 100_000:  # a flood of names: forget the ended windows
                self.windows = {k: v for k, v in self.windows.items() if v[1] > now}
            for key in keys:
                count, end = self.windows.get(key, (0, 0.0))
                self.windows[key] = (count + 1, end) if end > now else (
                    1, now + WINDOW_SECONDS)

    def succeeded(self, username: str) -> None:
        key = self.keys(username, "")[0]
        connection = self.connection()
        if connection is not None:
            try:
                connection.delete(key)
                return
            except Exception:
                logger.exception("could not clear failed logins in Redis")
        with self.lock:
            self.windows.pop(key, None)


throttle = LoginThrottle()


def client_address(request: HttpRequest | None) -> str:
    return str((request.META.get("REMOTE_ADDR") if request is not None else "") or "-")


class ThrottledAuthenticationForm(AuthenticationForm):
    """Django's authentication form, with failures counted and refused."""

    throttled = ""

    def clean(self) -> dict[str, Any]:
        username = str(self.cleaned_data.get("username") or "")
        address = client_address(self.request)
        wait = throttle.wait_seconds(username, address)
        if wait:
            self.throttled = (f"Too many failed login attempts for this account or from this "
                              f"address: try again in {wait} s.")
            raise forms.ValidationError(self.throttled, code="too_many_attempts")
        try:
            cleaned = super().clean()
        except forms.ValidationError as error:
            if getattr(error, "code", None) == "invalid_login":
                throttle.failed(username, address)
            raise
        throttle.succeeded(username)
        return cleaned


class ThrottledAdminAuthenticationForm(ThrottledAuthenticationForm, AdminAuthenticationForm):
    pass
