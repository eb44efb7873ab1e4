"""Rate-limit buckets (serving/ratelimit.py), in memory and in a real Redis: the budget per
minute, the Retry-After, refused requests using no budget, completion tokens charged after
the answer, and one budget shared by two limiters on the same Redis (as two gateway
processes would)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from serving.ratelimit import Limit, MemoryLimiter, RedisLimiter, key_limits, token_charges
from tests.serving.conftest import flush_redis_budgets

REDIS = "redis://127.0.0.1:6379/7"


def limiters() -> list[str]:
    return ["memory", "redis"]


def make(kind: str) -> MemoryLimiter | RedisLimiter:
    return MemoryLimiter() if kind == "memory" else RedisLimiter(REDIS)


def bucket() -> str:
    return f"test:{uuid.uuid4().hex}"


def script_calls(url: str) -> int:
    """The script calls the Redis at `url` has run (INFO commandstats)."""
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
               for name in ("evalsha", "eval"))


@pytest.mark.parametrize("kind", limiters())
def test_two_requests_a_minute_then_a_retry_after(kind: str) -> None:
    async def run() -> None:
        limiter = make(kind)
        rpm = [Limit("requests", bucket(), 2, 1)]
        first, second, third = [await limiter.admit(rpm) for _ in range(3)]
        assert first.allowed and second.allowed and not third.allowed
        assert 29 <= third.retry_after <= 30.5
        headers = dict(third.headers())
        assert headers[b"retry-after"] == b"30"
        assert headers[b"x-ratelimit-limit-requests"] == b"2"
        assert headers[b"x-ratelimit-remaining-requests"] == b"0"
        assert dict(first.headers())[b"x-ratelimit-remaining-requests"] == b"1"
        if isinstance(limiter, RedisLimiter):
            await limiter.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", limiters())
def test_a_refused_request_uses_no_budget_of_any_bucket(kind: str) -> None:
    async def run() -> None:
        limiter = make(kind)
        key, team = bucket(), bucket()
        assert (await limiter.admit([Limit("requests", team, 1, 1)])).allowed  # team spent
        both = [Limit("requests", key, 5, 1), Limit("requests", team, 1, 1)]
        assert not (await limiter.admit(both)).allowed
        # The key's own budget was not touched by the refused request: 5 left.
        alone = [Limit("requests", key, 5, 1)]
        verdicts = [await limiter.admit(alone) for _ in range(6)]
        assert [v.allowed for v in verdicts] == [True] * 5 + [False]
        if isinstance(limiter, RedisLimiter):
            await limiter.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", limiters())
def test_completion_tokens_are_charged_after_the_answer(kind: str) -> None:
    async def run() -> None:
        limiter = make(kind)
        tokens = bucket()
        assert (await limiter.admit([Limit("tokens", tokens, 1000, 100)])).allowed
        await limiter.charge([Limit("tokens", tokens, 1000, 950)])  # a long answer
        refused = await limiter.admit([Limit("tokens", tokens, 1000, 100)])
        assert not refused.allowed
        # 1050 of 1000 used: 150 tokens' worth (9 s) must pass before 100 more fit.
        assert 8.5 <= refused.retry_after <= 9.5
        assert dict(refused.headers())[b"x-ratelimit-remaining-tokens"] == b"0"
        if isinstance(limiter, RedisLimiter):
            await limiter.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", limiters())
def test_a_refund_gives_the_budget_back(kind: str) -> None:
    async def run() -> None:
        limiter = make(kind)
        rpm = [Limit("requests", bucket(), 2, 1)]
        assert (await limiter.admit(rpm)).allowed and (await limiter.admit(rpm)).allowed
        await limiter.refund(rpm)  # the second never reached a replica
        assert (await limiter.admit(rpm)).allowed
        assert not (await limiter.admit(rpm)).allowed
        fresh = [Limit("requests", bucket(), 2, 1)]
        await limiter.refund(fresh)  # nothing to give back: no credit beyond a full bucket
        verdicts = [await limiter.admit(fresh) for _ in range(3)]
        assert [v.allowed for v in verdicts] == [True, True, False]
        if isinstance(limiter, RedisLimiter):
            await limiter.close()

    asyncio.run(run())


def test_two_limiters_on_one_redis_share_one_budget() -> None:
    async def run() -> None:
        flush_redis_budgets(REDIS)
        first, second = RedisLimiter(REDIS), RedisLimiter(REDIS)
        rpm = [Limit("requests", bucket(), 3, 1)]
        verdicts = [await first.admit(rpm), await second.admit(rpm), await first.admit(rpm),
                    await second.admit(rpm)]
        assert [v.allowed for v in verdicts] == [True, True, True, False]
        await first.close()
        await second.close()

    asyncio.run(run())


def test_a_burst_of_requests_is_checked_not_refused_for_want_of_connections() -> None:
    """More requests at once than the client keeps connections (a gateway process under a
    burst): each waits its turn for one and is checked, none fails as if Redis were away
    (redis-py's default pool failed every command past 100 in flight, and the gateway
    answered 503 `limits_unavailable`)."""
    from serving.redis_clients import EVENT_LOOP_CONNECTIONS

    async def run() -> None:
        limiter = RedisLimiter(REDIS)
        rpm = [Limit("requests", bucket(), 1000, 1)]
        burst = 4 * EVENT_LOOP_CONNECTIONS + 50  # 306: past the default pool's 100 too
        verdicts = await asyncio.gather(*(limiter.admit(rpm) for _ in range(burst)))
        assert all(v.allowed for v in verdicts)
        # Every one was charged: the bucket has 1000 - 306 left.
        last = await limiter.admit(rpm)
        assert dict(last.headers())[b"x-ratelimit-remaining-requests"] == str(
            1000 - burst - 1).encode()
        await limiter.close()

    asyncio.run(run())


def test_checks_made_together_go_to_redis_in_one_call_and_are_judged_in_order() -> None:
    """A burst's checks (made in one turn of the event loop) reach Redis as one script
    call, not one each; each is judged after the ones made before it, as if sent one by
    one: with room for 3, the first 3 of 5 pass and the last 2 are refused. At most
    `most_per_call` checks go in a call."""
    from tests.services import private_redis

    async def run(url: str) -> None:
        limiter = RedisLimiter(url, most_per_call=4)
        await limiter.admit([Limit("requests", bucket(), 1000, 1)])  # connected, loaded
        rpm = [Limit("requests", bucket(), 3, 1)]
        before = script_calls(url)
        verdicts = await asyncio.gather(*(limiter.admit(rpm) for _ in range(5)))
        assert [v.allowed for v in verdicts] == [True, True, True, False, False]
        assert script_calls(url) - before == 2  # 4 checks, then 1
        assert [dict(v.headers())[b"x-ratelimit-remaining-requests"]
                for v in verdicts] == [b"2", b"1", b"0", b"0", b"0"]
        await limiter.close()

    with private_redis() as server:
        asyncio.run(run(server.url))


def test_a_script_call_carries_at_most_its_buckets_and_a_larger_check_goes_alone() -> None:
    """Checks made together go in calls of at most BATCH_BUCKETS buckets: three checks
    of 300 buckets take three calls, one of twice the limit goes alone and is judged."""
    from serving.ratelimit import BATCH_BUCKETS
    from tests.services import private_redis

    async def run(url: str) -> None:
        limiter = RedisLimiter(url)
        await limiter.admit([Limit("requests", bucket(), 1000, 1)])  # connected, loaded
        before = script_calls(url)
        wide = [[Limit("requests", bucket(), 1000, 1) for _ in range(300)]
                for _ in range(3)]
        verdicts = await asyncio.gather(*(limiter.admit(limits) for limits in wide))
        assert all(v.allowed for v in verdicts) and script_calls(url) - before == 3
        huge = [Limit("requests", bucket(), 1000, 1) for _ in range(2 * BATCH_BUCKETS)]
        assert (await limiter.admit(huge)).allowed
        assert script_calls(url) - before == 4
        await limiter.close()

    with private_redis() as server:
        asyncio.run(run(server.url))


def test_a_script_call_that_fails_fails_every_check_it_carried_and_none_waits_on() -> None:
    """A bucket Redis holds garbage in makes the script fail: every check sent in that
    call gets the error (the gateway answers 503 `limits_unavailable`), none is left
    waiting; the next call, without that bucket, is judged."""
    from redis.exceptions import ResponseError

    from serving.ratelimit import REDIS_PREFIX

    async def run() -> None:
        limiter = RedisLimiter(REDIS)
        spoilt, fine = bucket(), bucket()
        redis.Redis.from_url(REDIS).set(REDIS_PREFIX + spoilt, "not a time")
        outcomes = await asyncio.wait_for(asyncio.gather(
            limiter.admit([Limit("requests", spoilt, 10, 1)]),
            limiter.admit([Limit("requests", fine, 10, 1)]), return_exceptions=True), 5)
        assert [type(outcome) for outcome in outcomes] == [ResponseError, ResponseError]
        assert (await limiter.admit([Limit("requests", fine, 10, 1)])).allowed
        await limiter.close()

    asyncio.run(run())


def test_a_check_whose_caller_left_before_it_was_sent_charges_nothing() -> None:
    async def run() -> None:
        limiter = RedisLimiter(REDIS)
        rpm = [Limit("requests", bucket(), 10, 1)]
        left = asyncio.ensure_future(limiter.admit(rpm))
        await asyncio.sleep(0)  # its check joined the turn's batch
        left.cancel()
        verdict = await limiter.admit(rpm)
        assert dict(verdict.headers())[b"x-ratelimit-remaining-requests"] == b"9"
        await limiter.close()

    asyncio.run(run())


def test_after_a_redis_restart_the_kept_connections_do_not_fail_checks() -> None:
    """Redis restarted: every connection the client kept is dead. The checks made right
    after are counted on new connections, none fails as if Redis were still away (each
    kept connection used to fail its first command: a limited request answered 503)."""
    from tests.services import private_redis

    async def run(server: Any) -> None:
        limiter = RedisLimiter(server.url)
        rpm = [Limit("requests", bucket(), 1000, 1)]
        await asyncio.gather(*(limiter.admit(rpm) for _ in range(6)))  # six kept
        server.stop()
        with pytest.raises(RedisConnectionError):  # away: the check fails, as it must
            await limiter.admit(rpm)
        server.start()
        verdicts = await asyncio.gather(*(limiter.admit(rpm) for _ in range(6)),
                                        return_exceptions=True)
        assert [getattr(v, "allowed", v) for v in verdicts] == [True] * 6
        await limiter.close()

    with private_redis() as server:
        asyncio.run(run(server))


def test_the_buckets_of_a_key_and_its_team() -> None:
    from serving.keys import KeyInfo

    info = KeyInfo(7, "k", "inference", (), rpm=10, tpm=None, team_id=3, team_rpm=100,
                   team_tpm=5000)
    limits = key_limits(info, prompt_tokens=40)
    assert [(lim.bucket, lim.per_minute, lim.cost) for lim in limits] == [
        ("key:7:rpm", 10, 1), ("team:3:rpm", 100, 1), ("team:3:tpm", 5000, 40)]
    # A prompt larger than the whole budget is admitted on an empty bucket.
    assert key_limits(info, prompt_tokens=9000)[-1].cost == 5000
    assert [(lim.bucket, lim.cost) for lim in token_charges(info, 12, 40, 40)] == [
        ("team:3:tpm", 12)]
    assert token_charges(info, 0, 40, 40) == []
    # A 9000-token prompt was charged 5000 at admission: the rest is owed afterwards.
    assert [lim.cost for lim in token_charges(info, 10, 9000, 9000)] == [4010]
    assert key_limits(KeyInfo(8, "free", "inference", ()), 10) == []


def test_tokens_owed_after_answers_reach_redis_summed_in_one_call_and_none_lost_at_stop(
        settings: Any) -> None:
    """Answers ending together owe their tokens to a Redis budget: the charges are summed
    per bucket and sent in one script call (not one per answer), the budget then holds
    their sum; what is owed when the server stops is sent by `settle`, not dropped."""

    from serving.gateway.resources import CHARGE_BATCH_SECONDS, LiveStreams, Resources
    from serving.router import Router
    from tests.services import private_redis

    async def run(url: str) -> None:
        resources = Resources(asyncio.get_running_loop(), Router(), LiveStreams())
        resources.follow_settings()
        key_tpm, team_tpm = bucket(), bucket()
        limiter = resources.limiter
        assert isinstance(limiter, RedisLimiter)
        await limiter.admit([Limit("tokens", bucket(), 60_000, 0)])  # the script loaded
        calls_before = script_calls(url)
        for completion in (100, 250, -50, 700):  # four answers ending in one moment
            resources.owe([Limit("tokens", key_tpm, 60_000, completion),
                           Limit("tokens", team_tpm, 60_000, completion)])
        # The summed charge lands (within the batch window and a round trip).
        deadline = asyncio.get_running_loop().time() + 5
        used: list[float] = []
        checks = 0
        while asyncio.get_running_loop().time() < deadline:
            checks += 1
            verdict = await limiter.admit([Limit("tokens", key_tpm, 60_000, 0),
                                           Limit("tokens", team_tpm, 60_000, 0)],
                                          commit=False)
            used = verdict.used
            if used and min(used) > 0:
                break
            await asyncio.sleep(CHARGE_BATCH_SECONDS)
        # 1,000 tokens at 60,000 a minute: one second of budget in use in each bucket
        assert used == [pytest.approx(1.0, abs=0.05)] * 2
        charges_sent = script_calls(url) - calls_before - checks
        assert charges_sent <= 1, f"{charges_sent} script calls for four answers' charges"

        # Owed at the moment the server stops: sent by settle, before the timer fires.
        late = bucket()
        resources.owe([Limit("tokens", late, 60_000, 3_000)])
        await resources.settle(5)
        assert not resources.owed and resources.owed_timer is None
        peek = await limiter.admit([Limit("tokens", late, 60_000, 0)], commit=False)
        assert peek.used == [pytest.approx(3.0, abs=0.05)]
        await limiter.close()

    with private_redis() as server:
        settings.REDIS_URL = server.url
        asyncio.run(run(server.url))


def test_each_check_gets_its_verdict_as_the_scripts_reply_comes() -> None:
    """The checks made in one turn of the event loop are written to Redis in the next
    (not a turn later, at the first step of a task), and get their verdicts from the
    script's reply as the connection hands it over (its `first_look`), not once the
    call's task resumes: here that task never does, and the verdicts come all the same,
    each its own."""
    turns = [0]

    def count_turns() -> None:
        turns[0] += 1
        asyncio.get_running_loop().call_soon(count_turns)

    class ReplyThenHold:
        """A script client that shows the reply and then never returns."""

        def __init__(self) -> None:
            self.held = asyncio.Event()
            self.called_at: list[int] = []

        async def run(self, keys: list[str], args: list[str],
                      first_look: Any = None) -> Any:
            self.called_at.append(turns[0])
            reply = [[1, "0", f"{n}.0"] for n in range(len(keys))]
            first_look(reply)
            await self.held.wait()
            return reply

        async def close(self) -> None:
            return None

    async def run() -> None:
        limiter = RedisLimiter(REDIS)
        await limiter.script.close()
        limiter.script = ReplyThenHold()  # type: ignore[assignment]
        rpm = [Limit("requests", bucket(), 60, 1)]
        asyncio.get_running_loop().call_soon(count_turns)
        await asyncio.sleep(0)
        checks = [asyncio.ensure_future(limiter.admit(rpm)) for _ in range(3)]
        made_at = turns[0]  # the checks are made in the next turn
        verdicts = await asyncio.wait_for(asyncio.gather(*checks), 5)
        assert limiter.script.called_at == [made_at + 2]  # type: ignore[attr-defined]
        assert [v.used for v in verdicts] == [[0.0], [1.0], [2.0]]
        assert all(v.allowed for v in verdicts)
        assert len(limiter.sending) == 1  # the call itself still waits
        for task in limiter.sending:
            task.cancel()

    asyncio.run(run())
