"""Throttled logins, for the login page and the Django admin's.

Failed attempts are counted per (username, client address) and per client address, in
windows of a minute that start at the first attempt. At LOGIN_FAILURES_PER_MINUTE failures
for one username from one address, or ADDRESS_FACTOR times as many from one address for any
usernames (several people may share an address behind NAT), further attempts from there
are refused, without checking the password, until the window ends: a password guesser
gets a few tries a minute per address, whatever the password, and failures from elsewhere
never lock a user out of their own address. Each attempt is counted before its password is
checked (atomically: Redis INCR and EXPIRE in one transaction, or under a lock in this
process), so parallel attempts cannot slip past the limit; an attempt that turns out not
to fail is given back. A successful login clears its (username, address) count. Counts
live in Redis when REDIS_URL is set, so every process shares them; else in this process.
The address is REMOTE_ADDR: the connection's, or behind TRUSTED_PROXIES the client
address serving/proxies.py put into the ASGI scope.
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
# An address may fail this many times the per-username limit, across usernames.
ADDRESS_FACTOR = 4
REDIS_PREFIX = "fleetplane:login-failures:"
# Give an attempt back: a decrement only of a count still in its window (a DECR of an
# expired key would make a count without an expiry).
GIVE_BACK = """
if redis.call('exists', KEYS[1]) == 1 then return redis.call('decr', KEYS[1]) end
return 0
"""


class LoginThrottle:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: dict[str, tuple[int, float]] = {}  # key -> (attempts, window end)
        self.redis: Any = None
        self.redis_url = ""

    @staticmethod
    def keys(username: str, address: str) -> tuple[str, str]:
        """The (username, address) count's key and the address count's."""
        # Hashed: a username is whatever the form was sent, of any length.
        name = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
        address = address[:64]
        return (f"{REDIS_PREFIX}user:{name}:address:{address}",
                f"{REDIS_PREFIX}address:{address}")

    @staticmethod
    def limits() -> tuple[int, int]:
        limit = int(settings.LOGIN_FAILURES_PER_MINUTE)
        return limit, limit * ADDRESS_FACTOR

    def connection(self) -> Any:
        url = str(settings.REDIS_URL or "")
        if not url:
            return None
        if self.redis is None or self.redis_url != url:
            import redis

            self.redis = redis.Redis.from_url(url, socket_timeout=2)
            self.redis_url = url
        return self.redis

    def attempt(self, username: str, address: str) -> int:
        """Count an attempt for this username from this address before its password is
        checked: 0 when it may go on, else the seconds until attempts are taken again."""
        if not settings.LOGIN_FAILURES_PER_MINUTE:
            return 0
        keys = self.keys(username, address)
        connection = self.connection()
        if connection is not None:
            try:
                with connection.pipeline(transaction=True) as pipe:
                    for key in keys:
                        pipe.incr(key)
                        pipe.expire(key, WINDOW_SECONDS, nx=True)
                        pipe.pttl(key)
                    found = pipe.execute()
                counted = [(int(found[i]), max(int(found[i + 2]), 0) / 1000)
                           for i in (0, 3)]
                return self._wait(counted)
            except Exception:  # the store is away: count in this process meanwhile
                logger.exception("could not count a login attempt in Redis")
        now = monotonic()
        with self.lock:
            if len(self.windows) > 100_000:  # a flood of names: forget the ended windows
                self.windows = {k: v for k, v in self.windows.items() if v[1] > now}
            counted = []
            for key in keys:
                count, end = self.windows.get(key, (0, 0.0))
                count, end = (count + 1, end) if end > now else (1, now + WINDOW_SECONDS)
                self.windows[key] = (count, end)
                counted.append((count, end - now))
        return self._wait(counted)

    def _wait(self, counted: list[tuple[int, float]]) -> int:
        # A count over its limit (this attempt is one too many) holds attempts off until
        # its window ends; at least a second, so a refusal never reads "0 s".
        waits = [left for (count, left), limit in zip(counted, self.limits(), strict=True)
                 if count > limit]
        return max(1, math.ceil(max(waits))) if waits else 0

    def give_back(self, username: str, address: str, *, clear_username: bool) -> None:
        """An attempt that did not fail: uncount it; on a successful login also clear the
        (username, address) count, never the address's."""
        if not settings.LOGIN_FAILURES_PER_MINUTE:
            return
        user_key, address_key = self.keys(username, address)
        connection = self.connection()
        if connection is not None:
            try:
                if clear_username:
                    connection.delete(user_key)
                else:
                    connection.eval(GIVE_BACK, 1, user_key)
                connection.eval(GIVE_BACK, 1, address_key)
                return
            except Exception:
                logger.exception("could not give back a login attempt in Redis")
        with self.lock:
            if clear_username:
                self.windows.pop(user_key, None)
            for key in ((address_key,) if clear_username else (user_key, address_key)):
                count, end = self.windows.get(key, (0, 0.0))
                if count > 0:
                    self.windows[key] = (count - 1, end)


throttle = LoginThrottle()


def client_address(request: HttpRequest | None) -> str:
    return str((request.META.get("REMOTE_ADDR") if request is not None else "") or "-")


class ThrottledAuthenticationForm(AuthenticationForm):
    """Django's authentication form, with failures counted and refused."""

    throttled = ""

    def clean(self) -> dict[str, Any]:
        username = str(self.cleaned_data.get("username") or "")
        address = client_address(self.request)
        wait = throttle.attempt(username, address)
        if wait:
            # Counted only to see it was one too many: counts are of failed passwords.
            throttle.give_back(username, address, clear_username=False)
            self.throttled = (f"Too many failed login attempts for this account or from this "
                              f"address: try again in {wait} s.")
            raise forms.ValidationError(self.throttled, code="too_many_attempts")
        try:
            cleaned = super().clean()
        except forms.ValidationError as error:
            if getattr(error, "code", None) != "invalid_login":  # not a wrong password
                throttle.give_back(username, address, clear_username=False)
            raise
        except BaseException:
            throttle.give_back(username, address, clear_username=False)
            raise
        # Only a login that happened clears the count: a form sent without a password
        # checks nothing, and must not reset the guesses made before it.
        throttle.give_back(username, address, clear_username=self.get_user() is not None)
        return cleaned


class ThrottledAdminAuthenticationForm(ThrottledAuthenticationForm, AdminAuthenticationForm):
    pass
