"""Keys, budgets and priorities at the gateway, with the official `openai` client (and
httpx where headers are read) in front of FAKE engines: per-key and per-team limits with
429 + Retry-After + x-ratelimit-* headers, the same 401 for every kind of bad key, the
failed-attempt limit per address, priority classes and the queue when replicas are full,
context pools, and the priority handed to engines that schedule by it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from django.utils import timezone

from serving.models import ApiKey
from serving.services import create_api_key, create_team, revoke_api_key
from tests.serving.conftest import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

Engines = Callable[..., FakeEngine]
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def post(url: str, key: str, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body or BODY, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def wait_until(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_key_with_two_requests_a_minute_gets_429_on_the_third(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    _, key = create_api_key("tight", "inference", rpm=2)
    first, second = post(gateway_url, key), post(gateway_url, key)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    with pytest.raises(openai.RateLimitError) as refused:
        client(gateway_url, key).completions.create(model="fake", prompt="hi", max_tokens=2)
    response = refused.value.response
    assert 29 <= int(response.headers["retry-after"]) <= 31
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_team_budget_is_shared_by_its_keys(gateway_url: str,
                                             fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    create_team("search", rpm=3)
    _, first = create_api_key("a", "inference", team="search")
    _, second = create_api_key("b", "inference", team="search", rpm=100)
    codes = [post(gateway_url, k).status_code for k in (first, second, first, second)]
    assert codes == [200, 200, 200, 429]


def test_tokens_per_minute_reserve_the_prompt_and_n_times_max_tokens_at_admission(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1", interval_ms=50)])
    _, key = create_api_key("tokens", "inference", tpm=1000)
    body = {"model": "fake", "prompt": "x" * 40, "max_tokens": 200, "n": 4, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as running:
        assert running.status_code == 200
        # 10 estimated prompt tokens and 4 x 200 completion tokens, before a token was made
        assert running.headers["x-ratelimit-remaining-tokens"] == "190"
        refused = post(gateway_url, key, {"model": "fake", "prompt": "hi", "max_tokens": 400})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert post(gateway_url, key, {"model": "fake", "prompt": "hi", "max_tokens": 8}
                    ).status_code == 200


def test_a_chat_without_max_tokens_reserves_the_rest_of_the_context(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1", interval_ms=50)])  # a 2,048-token context
    _, key = create_api_key("open-ended", "inference", tpm=10_000)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as running:
        assert running.status_code == 200
        # 5 estimated prompt tokens, and 2 x the 2,043 tokens the engine may still write
        # (the header rounds down)
        assert 10_000 - 5 - 4086 - 1 <= int(running.headers["x-ratelimit-remaining-tokens"]
                                            ) <= 10_000 - 5 - 4086


def test_a_request_no_replica_answered_gives_its_tokens_back(
        gateway_url: str, fake_engines: Engines) -> None:
    from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
    from tests.processes import free_port

    _, key = create_api_key("unlucky", "inference", tpm=1000)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 900}
    gone = RouteReplica("gone-1", f"http://127.0.0.1:{free_port()}")
    routes.publish(build_table([DeploymentRoutes("demo", "fake", "least-load", 2048, (gone,),
                                          ("fake", "demo"))]))
    assert post(gateway_url, key, body).status_code == 503  # every try failed
    # A name no earlier test gave a replica: the gateway's view of a replica (its failures,
    # its time out of routing) is kept by name.
    publish("demo", [fake_engines("tokens-back-1")])
    assert post(gateway_url, key, body).status_code == 200  # the 900 came back


def test_a_client_that_leaves_a_non_streamed_answer_pays_its_reservation(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1", interval_ms=5)])
    _, key = create_api_key("impatient", "inference", tpm=1000)
    with pytest.raises(httpx.TimeoutException):  # 500 tokens take 2.5 s
        httpx.post(f"{gateway_url}/v1/completions", timeout=0.5,
                   json={"model": "fake", "prompt": "hi", "max_tokens": 500},
                   headers={"Authorization": f"Bearer {key}"})
    from serving.gateway import gateway

    wait_until(lambda: not gateway.key_in_flight)  # the gateway saw it go
    refused = post(gateway_url, key, {"model": "fake", "prompt": "hi", "max_tokens": 600})
    assert refused.status_code == 429


def test_while_keys_cannot_be_read_known_keys_work_and_others_get_503(
        gateway_url: str, fake_engines: Engines, settings: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import OperationalError

    from serving import keys

    publish("demo", [fake_engines("demo-1")])
    settings.KEY_CACHE_SECONDS = 0  # every request would ask the database
    _, known = create_api_key("known", "inference")
    _, unseen = create_api_key("unseen", "inference")
    assert post(gateway_url, known).status_code == 200

    def unreachable(key_hash: str) -> None:
        raise OperationalError("connection refused")  # what a stopped server gives

    monkeypatch.setattr(keys, "_lookup", unreachable)
    assert post(gateway_url, known).status_code == 200  # from the cache
    refused = post(gateway_url, unseen)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "keys_unavailable"


def test_every_bad_key_gets_the_same_401(gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    record, revoked = create_api_key("revoked", "inference")
    revoke_api_key(record)
    expiring, expired = create_api_key("expired", "inference",
                                       expires_at=timezone.now() + timedelta(seconds=1))
    _, good = create_api_key("good", "inference")
    assert post(gateway_url, expired).status_code == 200
    ApiKey.objects.filter(pk=expiring.pk).update(expires_at=timezone.now())
    from serving import keys

    keys.clear_cache()  # what a save does; the update above skips the signal
    answers = [post(gateway_url, k) for k in (
        revoked, expired, "fp-" + "A" * 43, good[:-3], good + "x", "not-even-close")]
    assert [a.status_code for a in answers] == [401] * 6
    assert len({a.text for a in answers}) == 1  # nothing says which case it was
    assert post(gateway_url, good).status_code == 200


def test_failed_attempts_from_an_address_never_lock_out_a_valid_key(
        gateway_url: str, settings: Any, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    settings.GATEWAY_AUTH_FAILURES_PER_MINUTE = 3
    _, good = create_api_key("good", "inference")
    codes = [post(gateway_url, f"fp-guess{n}").status_code for n in range(5)]
    assert codes == [401, 401, 401, 429, 429]
    assert post(gateway_url, good).status_code == 200  # same address, valid key: served
    held = post(gateway_url, "fp-guess-again")  # further guesses stay held off
    assert held.status_code == 429 and int(held.headers["retry-after"]) >= 1
    assert held.json()["error"]["code"] == "too_many_auth_failures"
    assert post(gateway_url, good).status_code == 200


def test_a_key_may_ask_for_a_lower_priority_but_not_a_higher_one(
        gateway_url: str, fake_engines: Engines) -> None:
    publish("demo", [fake_engines("demo-1")])
    _, key = create_api_key("standard", "inference", priority="standard")
    assert post(gateway_url, key, headers={"X-Priority": "batch"}).status_code == 200
    higher = post(gateway_url, key, headers={"X-Priority": "critical"})
    assert higher.status_code == 403
    assert higher.json()["error"]["code"] == "priority_not_allowed"
    unknown = post(gateway_url, key, headers={"X-Priority": "urgent!!"})
    assert unknown.status_code == 400 and "critical, standard, batch" in unknown.text


def test_when_replicas_are_full_requests_queue_by_priority(
        gateway_url: str, fake_engines: Engines) -> None:
    # One replica taking one request at a time; each answer takes about 1 s, time enough
    # for the others to line up on a busy machine.
    publish("demo", [fake_engines("demo-1", interval_ms=50)], replica_concurrency=1)
    _, batch = create_api_key("batch", "inference", priority="batch")
    _, critical = create_api_key("critical", "inference", priority="critical")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 20}
    finished: list[tuple[str, httpx.Response]] = []

    def send(name: str, key: str) -> None:
        finished.append((name, post(gateway_url, key, body)))

    from serving.gateway import gateway

    def waiting(count: int) -> Callable[[], bool]:
        return lambda: sum(gateway.admission.queued("demo").values()) == count

    threads = [threading.Thread(target=send, args=("batch-0", batch))]
    threads[0].start()
    wait_until(lambda: gateway.admission.lane("demo|all").busy == 1)  # it holds the slot
    for count, (name, key) in enumerate((("batch-1", batch), ("batch-2", batch),
                                         ("critical", critical)), start=1):
        threads.append(threading.Thread(target=send, args=(name, key)))
        threads[-1].start()
        wait_until(waiting(count))  # in the queue, in this order
    for thread in threads:
        thread.join(timeout=30)
    order = [name for name, _ in finished]
    assert order == ["batch-0", "critical", "batch-1", "batch-2"]
    answers = dict(finished)
    assert all(a.status_code == 200 for a in answers.values())
    assert answers["batch-0"].headers["x-queue-position"] == "0"
    assert answers["critical"].headers["x-queue-position"] == "1"  # ahead of both batch
    assert answers["batch-2"].headers["x-queue-position"] == "2"
    assert int(answers["batch-2"].headers["x-queue-wait-ms"]) > 400


def test_a_full_queue_answers_429_and_a_long_wait_503(
        gateway_url: str, fake_engines: Engines, settings: Any) -> None:
    from serving.priority import parse_classes

    settings.PRIORITY_CLASSES = parse_classes(
        '{"standard": {"level": 10, "max_queued": 1, "max_wait_seconds": 0.5}}')
    publish("demo", [fake_engines("demo-1", interval_ms=100)], replica_concurrency=1)
    _, key = create_api_key("k", "inference")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 20}  # about 2 s each
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(post(gateway_url, key, body)))
               for _ in range(2)]
    from serving.gateway import gateway

    threads[0].start()  # one runs
    wait_until(lambda: gateway.admission.lane("demo|all").busy == 1)
    threads[1].start()  # one waits
    wait_until(lambda: gateway.admission.queued("demo") == {"standard": 1})
    full = post(gateway_url, key, body)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    for thread in threads:
        thread.join(timeout=30)
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 503]  # the waiter gave up after 0.5 s
    timed_out = next(a for a in answers if a.status_code == 503)
    assert timed_out.json()["error"]["code"] == "queue_timeout"
    assert "retry-after" in timed_out.headers


def test_long_prompts_go_to_the_long_context_pool(gateway_url: str,
                                                  fake_engines: Engines) -> None:
    short, long = fake_engines("demo-short"), fake_engines("demo-long")
    publish("demo", [short, long], long_prompt_tokens=100, long_replicas=("demo-long",))
    _, key = create_api_key("k", "inference")
    for _ in range(3):
        assert post(gateway_url, key).status_code == 200
    assert post(gateway_url, key, {"model": "fake", "prompt": "word " * 200,
                                   "max_tokens": 2}).status_code == 200
    assert short.metric("fake:requests_total") == 3
    assert long.metric("fake:requests_total") == 1


def test_engines_scheduling_by_priority_receive_the_level(gateway_url: str,
                                                          fake_engines: Engines) -> None:
    engine = fake_engines("demo-1")
    publish("demo", [engine], priority_scheduling=True)
    _, key = create_api_key("k", "inference", priority="critical")
    assert post(gateway_url, key).status_code == 200
    assert post(gateway_url, key, headers={"X-Priority": "batch"}).status_code == 200
    assert engine.metric('fake:requests_by_priority_total{priority="0"}') == 1
    assert engine.metric('fake:requests_by_priority_total{priority="20"}') == 1


def test_usage_totals_add_up_on_the_key(gateway_url: str, fake_engines: Engines,
                                        settings: Any) -> None:
    settings.USAGE_FLUSH_SECONDS = 0.1
    publish("demo", [fake_engines("demo-1")])
    record, key = create_api_key("counted", "inference")
    for _ in range(3):
        assert post(gateway_url, key).status_code == 200

    def totals() -> tuple[int, int, int]:
        record.refresh_from_db()
        return (record.requests_total, record.prompt_tokens_total,
                record.completion_tokens_total)

    deadline = time.monotonic() + 10
    while totals() != (3, 15, 6) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert totals() == (3, 15, 6)
    assert record.last_used_at is not None


def test_an_unreachable_budget_store_refuses_limited_keys_with_503(
        gateway_url: str, fake_engines: Engines, settings: Any) -> None:
    publish("demo", [fake_engines("demo-1")])
    _, limited = create_api_key("limited", "inference", rpm=100)
    _, free = create_api_key("free", "inference")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    refused = post(gateway_url, limited)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "limits_unavailable"
    assert refused.headers["retry-after"] == "1"
    assert post(gateway_url, free).status_code == 200  # no budget to check
    # A wrong key is still a 401: no count of failed attempts to go by is no server error.
    assert post(gateway_url, "fp-wrong").status_code == 401


def test_a_client_that_leaves_the_queue_frees_its_place_and_its_budget(
        gateway_url: str, fake_engines: Engines, settings: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    from serving.gateway import gateway
    from serving.priority import parse_classes

    publish("demo", [fake_engines("demo-1", interval_ms=100)], replica_concurrency=1)
    _, key = create_api_key("k", "inference", rpm=3)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 10}  # about 1 s each
    first = threading.Thread(target=post, args=(gateway_url, key, body))
    first.start()
    wait_until(lambda: gateway.admission.lane("demo|all").busy == 1)
    with pytest.raises(httpx.TimeoutException):  # waits in the queue, then gives up
        httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=0.3,
                   headers={"Authorization": f"Bearer {key}"})
    wait_until(lambda: gateway.admission.queued("demo") == {})  # gone from the queue
    # A client's leaving is no error of the application's (uvicorn logs those).
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.message]
    settings.PRIORITY_CLASSES = parse_classes('{"standard": {"level": 10, "max_queued": 0}}')
    full = [post(gateway_url, key, body) for _ in range(2)]
    assert [a.json()["error"]["code"] for a in full] == ["queue_full"] * 2
    first.join(timeout=30)
    # 1 served + 3 that never reached a replica, on a budget of 3 a minute: the three
    # were given back, so this one still fits.
    assert post(gateway_url, key, body).status_code == 200
