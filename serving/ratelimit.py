"""Requests-per-minute and tokens-per-minute limits, per key and per team.

Each limit is a GCRA bucket (the "generic cell rate algorithm"): one number per bucket, the
time at which it is empty again (its theoretical arrival time, TAT). A limit of L per
minute lets a unit through every 60/L s with a burst of up to L; a request of cost c moves
the TAT on by c·60/L and is refused when that would put it more than 60 s ahead of now.
The wait until it would fit is the Retry-After.

A request is admitted only when every bucket it touches has room, and then it is charged
to all of them at once: a refused request uses no budget, and neither does one refused
later, before it reached a replica (a full queue, a wait too long, no replica, the client
gone): the gateway refunds it. Completion tokens are charged
when the response ends, whatever the room (a long answer delays the next requests).

In memory for one process (the embedded default); in Redis when REDIS_URL is set, a Lua
script so several gateway processes share one budget, timed by Redis's clock (the checks
arriving together sent in one call, their verdicts handed out as its reply comes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from serving.upstream.eager import run_eagerly

logger = logging.getLogger(__name__)

WINDOW = 60.0  # seconds: limits are per minute
REDIS_PREFIX = "fleetplane:rl:"


class Limit(NamedTuple):
    """One bucket a request is charged to, and its cost (a tuple: a rate-limited request
    makes two to four of them)."""

    kind: str  # "requests" or "tokens": which x-ratelimit-* headers it feeds
    bucket: str  # e.g. "key:12:rpm"
    per_minute: int
    cost: float

    @property
    def interval(self) -> float:
        """Seconds of budget one unit of cost takes."""
        return WINDOW / self.per_minute

    def given_back(self) -> Limit:
        """The same bucket, its cost taken back."""
        return self._replace(cost=-self.cost)


# The x-ratelimit-* header names of each kind of limit: limit, remaining, reset.
HEADER_NAMES = {kind: (f"x-ratelimit-limit-{kind}".encode(),
                       f"x-ratelimit-remaining-{kind}".encode(),
                       f"x-ratelimit-reset-{kind}".encode())
                for kind in ("requests", "tokens")}


@dataclass
class Verdict:
    """Whether a request fits its limits, and what they have left."""

    allowed: bool
    retry_after: float = 0.0
    # per limit: seconds of budget in use after this request (before it, when refused)
    used: list[float] = field(default_factory=list)
    limits: list[Limit] = field(default_factory=list)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers, from the tightest limit of each kind."""
        tightest: dict[str, tuple[int, int, float]] = {}
        for limit, used in zip(self.limits, self.used, strict=True):
            remaining = max(0, math.floor((WINDOW - used) / limit.interval + 1e-9))
            known = tightest.get(limit.kind)
            if known is None or remaining < known[1]:
                tightest[limit.kind] = (limit.per_minute, remaining, max(0.0, used))
        out: list[tuple[bytes, bytes]] = []
        for kind, (limit_name, remaining_name, reset_name) in HEADER_NAMES.items():
            found = tightest.get(kind)
            if found is not None:
                out += [(limit_name, b"%d" % found[0]), (remaining_name, b"%d" % found[1]),
                        (reset_name, b"%.1fs" % found[2])]
        if not self.allowed:
            out.append((b"retry-after", str(max(1, math.ceil(self.retry_after))).encode()))
        return out


def _step(stored: float | None, now: float, limit: Limit) -> float:
    return max(stored or now, now) + limit.cost * limit.interval


class MemoryLimiter:
    """For one gateway process: the checks run on its event loop, so nothing interleaves."""

    def __init__(self) -> None:
        self.buckets: dict[str, float] = {}

    async def admit(self, limits: list[Limit], *, commit: bool = True) -> Verdict:
        """Check (and with `commit`, charge) every limit at once."""
        now = time.time()
        buckets = self.buckets
        after = []
        worst = 0.0
        for limit in limits:  # written out: this runs before every limited request
            tat = _step(buckets.get(limit.bucket), now, limit)
            after.append(tat)
            worst = max(worst, tat - now - WINDOW)
        if worst > 1e-9:
            used = [max(buckets.get(limit.bucket, now), now) - now for limit in limits]
            return Verdict(False, worst, used, limits)
        if commit:
            for limit, tat in zip(limits, after, strict=True):
                buckets[limit.bucket] = tat
            if len(buckets) > 200_000:
                self.buckets = {k: v for k, v in buckets.items() if v > now}
        return Verdict(True, 0.0, [t - now for t in after], limits)

    async def charge(self, limits: list[Limit]) -> None:
        """Charge the limits whatever their room."""
        self.charge_now(limits)

    def charge_now(self, limits: list[Limit]) -> None:
        """The same, as a plain call (nothing here waits)."""
        now = time.time()
        for limit in limits:
            self.buckets[limit.bucket] = _step(self.buckets.get(limit.bucket), now, limit)

    async def refund(self, limits: list[Limit]) -> None:
        """Give back what an admitted request was charged."""
        await self.charge([limit.given_back() for limit in limits])


# One script call runs the checks that arrived together, in order, each seeing the ones
# before it. KEYS: every check's buckets, one check after the other. ARGV: per check its
# mode, "admit", "peek" (check only) or "charge" (no check), its number of buckets, then
# per bucket its interval and cost. Returns per check {allowed, retry_after, used...}.
# Times are written to the microsecond: Lua's tostring keeps 14 digits, which rounds an
# epoch time by up to 0.1 ms, and could refuse a later check in the same call that fits
# exactly.
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local replies = {}
local k, a = 0, 0
while a < #ARGV do
  local mode, n = ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 2
  local stored, after = {}, {}
  local worst = 0
  for i = 1, n do
    local tat = tonumber(redis.call('GET', KEYS[k + i]) or '0')
    if tat < now then tat = now end
    stored[i] = tat
    after[i] = tat + tonumber(ARGV[a + 2 * i]) * tonumber(ARGV[a + 2 * i - 1])
    if after[i] - now - 60 > worst then worst = after[i] - now - 60 end
  end
  local out
  if mode ~= 'charge' and worst > 1e-6 then
    out = {0, string.format('%.6f', worst)}
    for i = 1, n do out[#out + 1] = string.format('%.6f', stored[i] - now) end
  else
    out = {1, '0'}
    for i = 1, n do
      if mode ~= 'peek' then
        redis.call('SET', KEYS[k + i], string.format('%.6f', after[i]), 'PX',
                   math.max(math.ceil((after[i] - now) * 1000) + 1000, 1000))
      end
      out[#out + 1] = string.format('%.6f', after[i] - now)
    end
  end
  replies[#replies + 1] = out
  k, a = k + n, a + 2 * n
end
return replies
"""

# The most checks and buckets one script call carries (Redis runs nothing else while a
# script runs); a check with more buckets than that goes alone.
BATCH_CHECKS = 128
BATCH_BUCKETS = 512

Check = tuple[str, list[Limit], asyncio.Future[Verdict]]


def settle(checks: list[Check], replies: Any) -> None:
    """Each check's verdict from the script's reply (once: a caller given its verdict is
    not given it again)."""
    verdicts = [Verdict(bool(int(result[0])), float(result[1]),
                        [float(v) for v in result[2:]], limits)
                for (_, limits, _), result in zip(checks, replies, strict=True)]
    for (_, _, waiting), verdict in zip(checks, verdicts, strict=True):
        if not waiting.done():
            waiting.set_result(verdict)


class RedisLimiter:
    """Shared by every gateway process using the same Redis: the script on the event
    loop's own pipelined connection (serving/redis_script.py). The checks made in one
    turn of the event loop (a burst of requests) go to Redis in one script call, up to
    `most_per_call` checks and BATCH_BUCKETS buckets each: Redis pays a call's fixed cost
    once for them, and this process one write, one reply and one timer. A call is
    written in the turn after its checks were made, not at the first step of a task a
    turn later, and its checks get their verdicts from the connection's callback as the
    reply comes, not from the call's task a turn later: in a burst, each such turn waits
    behind the other requests' work."""

    def __init__(self, url: str, *, most_per_call: int = BATCH_CHECKS) -> None:
        from serving.redis_script import ScriptClient

        self.script = ScriptClient(url, SCRIPT)
        self.most_per_call = max(1, most_per_call)
        self.waiting: list[Check] = []
        self.sending: set[asyncio.Future[None]] = set()

    async def _run(self, mode: str, limits: list[Limit]) -> Verdict:
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[Verdict] = loop.create_future()
        if not self.waiting:  # the first of this turn: sent once the turn's others joined
            loop.call_soon(self.send_waiting)
        self.waiting.append((mode, limits, verdict))
        return await verdict

    def send_waiting(self) -> None:
        """Send the checks that joined since the last call, in calls of at most
        `most_per_call` checks and BATCH_BUCKETS buckets."""
        waiting, self.waiting = self.waiting, []
        batch: list[Check] = []
        buckets = 0
        for check in waiting:
            if batch and (len(batch) == self.most_per_call
                          or buckets + len(check[1]) > BATCH_BUCKETS):
                self.start_sending(batch)
                batch, buckets = [], 0
            batch.append(check)
            buckets += len(check[1])
        if batch:
            self.start_sending(batch)

    def start_sending(self, checks: list[Check]) -> None:
        """One script call for `checks`, written at once (not a turn of the event loop
        later, at the first step of a task); what is left once it waits for Redis runs
        in a task held until it ends."""
        task = run_eagerly(self.send(checks))
        if not task.done():
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def send(self, checks: list[Check]) -> None:
        """One script call for `checks`; each caller gets its verdict, or the error."""
        checks = [check for check in checks if not check[2].done()]  # its caller left
        if not checks:
            return
        keys: list[str] = []
        args: list[str] = []
        for mode, limits, _ in checks:
            args += [mode, str(len(limits))]
            for limit in limits:
                keys.append(REDIS_PREFIX + limit.bucket)
                args += [repr(limit.interval), repr(float(limit.cost))]
        try:
            # Each caller gets its verdict from the connection's callback as the reply
            # comes, a turn of the event loop sooner than from here.
            replies = await self.script.run(keys, args, partial(settle, checks))
            if not all(waiting.done() for _, _, waiting in checks):
                settle(checks, replies)
        except asyncio.CancelledError:
            for _, _, waiting in checks:
                waiting.cancel()
            raise
        except Exception as exc:  # no caller may wait for ever: each gets the error
            for _, _, waiting in checks:
                if not waiting.done():
                    waiting.set_exception(exc)

    async def admit(self, limits: list[Limit], *, commit: bool = True) -> Verdict:
        """Check (and with `commit`, charge) every limit at once."""
        return await self._run("admit" if commit else "peek", limits)

    async def charge(self, limits: list[Limit]) -> None:
        """Charge the limits whatever their room."""
        await self._run("charge", limits)

    async def refund(self, limits: list[Limit]) -> None:
        """Give back what an admitted request was charged (it never reached a replica)."""
        await self._run("charge", [limit.given_back() for limit in limits])

    async def close(self) -> None:
        """Close its connection."""
        await self.script.close()


Limiter = MemoryLimiter | RedisLimiter


def key_limits(info: Any, prompt_tokens: int, reserved: int = 0) -> list[Limit]:
    """The buckets a request with this key touches, at admission: one request, and the
    prompt's estimated tokens plus the completion tokens it may ask for (`reserved`:
    n x max_tokens), so a request cannot take more than its key has left."""
    limits = []
    for owner, rpm, tpm in ((f"key:{info.key_id}", info.rpm, info.tpm),
                            (f"team:{info.team_id}", info.team_rpm, info.team_tpm)):
        if owner.endswith(":None"):
            continue
        if rpm:
            limits.append(Limit("requests", f"{owner}:rpm", rpm, 1))
        if tpm:
            # A prompt larger than the whole budget is let in on an empty bucket (and
            # the bucket then stays full for longer), not refused forever.
            limits.append(Limit("tokens", f"{owner}:tpm", tpm,
                                min(max(1, prompt_tokens + reserved), tpm)))
    return limits


def token_charges(info: Any, completion: int, prompt: int | None, estimated: int,
                  reserved: int = 0) -> list[Limit]:
    """What each token bucket is owed once the answer has ended: the prompt (the engine's
    count, else the estimate) and the completion, less what admission charged (the
    estimate and the reservation, capped at the bucket's size). Negative when less was
    used than reserved: the difference is given back."""
    charges = []
    for owner, tpm in ((f"key:{info.key_id}", info.tpm),
                       (f"team:{info.team_id}", info.team_tpm)):
        if not tpm or owner.endswith(":None"):
            continue
        charged = min(max(1, estimated + reserved), tpm)
        owed = max(0, completion) + (prompt if prompt is not None else estimated) - charged
        if owed:
            charges.append(Limit("tokens", f"{owner}:tpm", tpm, owed))
    return charges
