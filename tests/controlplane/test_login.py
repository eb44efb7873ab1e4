"""Throttled logins (controlplane/login.py): the login page and the admin's, through
Django's test client, with the counts in this process and in the real Redis server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from django.contrib.auth.models import User
from django.test import Client

from controlplane import login
from controlplane.login import REDIS_PREFIX, LoginThrottle

pytestmark = pytest.mark.django_db

REDIS_URL = "redis://127.0.0.1:6379/7"


def forget_redis_counts() -> None:
    connection = redis.Redis.from_url(REDIS_URL)
    names = list(connection.scan_iter(REDIS_PREFIX + "*"))
    if names:
        connection.delete(*names)
    connection.close()


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, settings: Any,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Counts kept in this process, or in Redis (REDIS_URL set)."""
    settings.LOGIN_FAILURES_PER_MINUTE = 3
    settings.REDIS_URL = REDIS_URL if request.param == "redis" else None
    monkeypatch.setattr(login, "throttle", LoginThrottle())
    forget_redis_counts()
    yield request.param
    forget_redis_counts()


@pytest.fixture
def ada(db: None) -> User:
    return User.objects.create_user("ada", password="correct-horse-battery", is_staff=True)


def attempt(password: str, *, username: str = "ada", address: str = "10.0.0.1",
            path: str = "/login/") -> Any:
    return Client(REMOTE_ADDR=address).post(path, {"username": username,
                                                   "password": password})


def test_a_user_failing_from_one_address_is_refused_there_and_logs_in_from_another(
        store: str, ada: User) -> None:
    for _ in range(3):
        assert attempt("wrong", address="10.0.0.1").status_code == 200
    refused = attempt("correct-horse-battery", address="10.0.0.1")
    assert refused.status_code == 200  # the form again, not the redirect of a login
    text = refused.content.decode()
    assert "Too many failed login attempts for this account or from this address" in text
    assert "_auth_user_id" not in refused.wsgi_request.session
    # Whoever guesses elsewhere cannot lock the user out of their own address.
    assert attempt("correct-horse-battery", address="10.0.0.2").status_code == 302


def test_failures_for_a_user_from_many_addresses_do_not_lock_the_user_out(
        store: str, ada: User) -> None:
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        for _ in range(3):
            attempt("wrong", address=address)
    assert attempt("correct-horse-battery", address="10.0.0.4").status_code == 302


def test_an_address_failing_too_often_is_refused_for_every_username(
        store: str, ada: User) -> None:
    # Four times the per-user limit, across usernames: people behind one NAT get room.
    for index in range(12):
        attempt("guess", username=f"user{index}", address="10.0.0.9")
    refused = attempt("correct-horse-battery", address="10.0.0.9")
    assert "Too many failed login attempts" in refused.content.decode()
    assert attempt("correct-horse-battery", address="10.0.0.10").status_code == 302


@pytest.mark.django_db(transaction=True)
def test_parallel_guesses_get_no_more_password_checks_than_the_limit(
        store: str, ada: User, settings: Any) -> None:
    # A slow hasher, as in production: every guess is in flight while the others start.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    ada.set_password("correct-horse-battery")
    ada.save()
    start = threading.Barrier(8)

    def guess(index: int) -> str:
        client = Client(REMOTE_ADDR="10.0.0.1")
        start.wait()
        return client.post("/login/", {"username": "ada",
                                       "password": f"guess-{index}"}).content.decode()

    with ThreadPoolExecutor(8) as pool:
        pages = list(pool.map(guess, range(8)))
    checked = [page for page in pages if "Too many failed login attempts" not in page]
    assert len(checked) == 3


def test_a_few_failures_then_the_right_password_logs_in(store: str, ada: User) -> None:
    attempt("wrong")
    attempt("wrong")
    assert attempt("correct-horse-battery").status_code == 302


def test_a_form_sent_without_a_password_does_not_reset_the_count(
        store: str, ada: User) -> None:
    attempt("wrong")
    attempt("wrong")
    attempt("")  # checks nothing: it must not count as the login that clears the count
    attempt("wrong")
    refused = attempt("correct-horse-battery")
    assert "Too many failed login attempts" in refused.content.decode()


def test_the_admins_login_page_is_throttled_too(store: str, ada: User) -> None:
    for _ in range(3):
        attempt("wrong", path="/admin/login/")
    refused = attempt("correct-horse-battery", path="/admin/login/")
    assert refused.status_code == 200
    assert "Too many failed login attempts" in refused.content.decode()


def test_a_refused_username_is_taken_again_once_its_minute_has_passed(
        settings: Any, ada: User, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.LOGIN_FAILURES_PER_MINUTE = 3
    settings.REDIS_URL = None
    clock = [1000.0]
    monkeypatch.setattr(login, "monotonic", lambda: clock[0])
    monkeypatch.setattr(login, "throttle", LoginThrottle())
    for _ in range(3):
        attempt("wrong")
    assert "try again in 60 s" in attempt("correct-horse-battery").content.decode()
    clock[0] += 45
    assert "try again in 15 s" in attempt("correct-horse-battery").content.decode()
    clock[0] += 15
    assert attempt("correct-horse-battery").status_code == 302


def test_counts_in_redis_are_seen_by_every_process(settings: Any) -> None:
    settings.LOGIN_FAILURES_PER_MINUTE = 2
    settings.REDIS_URL = REDIS_URL
    forget_redis_counts()
    one, other = LoginThrottle(), LoginThrottle()  # as two server processes hold
    assert one.attempt("ada", "10.0.0.1") == 0
    assert other.attempt("ada", "10.0.0.1") == 0
    assert 55 <= one.attempt("ada", "10.0.0.1") <= 60
    forget_redis_counts()


@pytest.mark.django_db(transaction=True)
async def test_behind_a_trusted_proxy_each_forwarded_client_is_counted_alone(
        settings: Any, ada: User, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the ASGI application, as the server runs it: the proxy's own address is
    not what is counted, the client it forwards for is (TRUSTED_PROXIES)."""
    from controlplane.asgi import application

    settings.TRUSTED_PROXIES = ["10.1.1.1"]
    settings.LOGIN_FAILURES_PER_MINUTE = 3
    settings.REDIS_URL = None
    monkeypatch.setattr(login, "throttle", LoginThrottle())
    transport = httpx.ASGITransport(app=application, client=("10.1.1.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        await client.get("/login/")
        token = client.cookies["csrftoken"]

        async def attempt_through_proxy(username: str, password: str,
                                        forwarded_for: str) -> httpx.Response:
            return await client.post("/login/", headers={"X-Forwarded-For": forwarded_for},
                                     data={"username": username, "password": password,
                                           "csrfmiddlewaretoken": token})

        for _ in range(3):
            await attempt_through_proxy("ada", "guess", "203.0.113.5")
        held = await attempt_through_proxy("ada", "correct-horse-battery", "203.0.113.5")
        assert "Too many failed login attempts" in held.text
        other = await attempt_through_proxy("ada", "correct-horse-battery", "203.0.113.6")
        assert other.status_code == 302
