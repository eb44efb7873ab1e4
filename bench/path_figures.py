"""The paths a load is sent down and their figures, for bench/gateway_overhead.py and the
benchmarks built on it: the loads, an endpoint (a path: the engines themselves, a gateway
or a router, and the process that relays it), each path's figures over interleaved rounds
(TTFT, tokens/s, CPU per relayed event and per request, the wait for a CPU per event,
collections of the cycle collector), the rounds themselves, and the printed rows, table
and targets (each judged in bench/spread.py, with its spread over the rounds)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.spread import check_targets
from bench.stream_load import Run, load
from bench.usage_waits import after_records, held_in, now_as_stored


@dataclass(frozen=True)
class Load:
    """One load of the side-by-side table: `streams` clients, each sending `requests`
    streamed completions of `tokens` tokens one after another per round."""

    name: str
    label: str
    model: str  # "fake": the paced engine; "fast": the unpaced one
    streams: int
    requests: int
    tokens: int = 256


LOADS = {load.name: load for load in (
    Load("paced-1", "paced 10 ms/token", "fake", 1, 2),
    Load("paced-16", "paced 10 ms/token", "fake", 16, 1),
    Load("paced-128", "paced 10 ms/token", "fake", 128, 1),
    # Unpaced rounds repeat requests so that a round lasts about a second, not a few ms.
    Load("unpaced-1", "unpaced", "fast", 1, 50),
    Load("unpaced-64", "unpaced", "fast", 64, 8),
)}


@dataclass
class Endpoint:
    """One path to the engines: the engines themselves, the gateway or the routers."""

    name: str
    urls: dict[str, str]  # model -> base URL
    key: str | None
    pids: dict[str, int]  # model -> the process that relays it; none for the engine
    metrics: str | None = None  # the control plane's /metrics, where it has one
    database: Path | None = None  # the project's gateway's SQLite file (its usage records)

    def collections(self) -> int:
        """The cycle collector's runs in the relaying process so far (every generation),
        from its /metrics (python_gc_collections_total); 0 without one."""
        if self.metrics is None:
            return 0
        text = httpx.get(self.metrics, timeout=10).text
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("python_gc_collections_total{"))

    def cpu_reading(self, model: str) -> CpuReading:
        """The CPU of the process relaying `model` and its children (every thread) so
        far (see CpuReading); none for the engine itself."""
        import psutil

        if model not in self.pids:
            return CpuReading(0.0, {})
        total = 0.0
        threads: dict[tuple[int, int], int] = {}
        waits: dict[tuple[int, int], int] = {}
        process = psutil.Process(self.pids[model])
        members = (process, *helpers_of(process))
        for member in members:
            with contextlib.suppress(psutil.Error):
                times = member.cpu_times()
                total += times.user + times.system
                for thread, (ran, waited) in thread_schedstat(member.pid).items():
                    threads[thread], waits[thread] = ran, waited
        return CpuReading(total, threads, len(members), waits)


@dataclass(frozen=True)
class CpuReading:
    """A process tree's CPU so far: psutil's user + system, which Linux gives in clock
    ticks (10 ms each: a reading is up to 20 ms short per process, a quarter of what one
    paced stream's round costs), and each thread's time on a CPU in nanoseconds, the
    scheduler's own count (/proc/PID/task/TID/schedstat), keyed by (process, thread)."""

    ticks: float
    threads: dict[tuple[int, int], int]
    processes: int = 1
    # Each thread's nanoseconds runnable but not yet running (the same file's second
    # field): the machine's other processes held the cores, or an idle one was waking.
    waits: dict[tuple[int, int], int] = field(default_factory=dict)

    def waited_since(self, before: CpuReading) -> float | None:
        """Seconds the threads waited for a CPU from `before` to this reading; None where
        a thread of `before` is gone or went back (the wait of a thread that ended is not
        known) or there are no counts. A thread that came and went between the two
        readings is not seen: its wait is left out."""
        after = self.waits
        if not after or not before.waits.keys() <= after.keys() or any(
                after[thread] < waited for thread, waited in before.waits.items()):
            return None
        return sum(waited - before.waits.get(thread, 0)
                   for thread, waited in after.items()) / 1e9

    def since(self, before: CpuReading) -> float:
        """Seconds of CPU from `before` to this reading: the threads' own counts, unless
        a thread of `before` is gone or went back (a thread that ended took its count
        with it; its number may be another's now) or the ticks say more than the
        threads by over their rounding (a thread came and went between the readings):
        then the ticks."""
        after = self.threads
        ticks = self.ticks - before.ticks
        if not after or not before.threads.keys() <= after.keys() or any(
                after[thread] < spent for thread, spent in before.threads.items()):
            return ticks
        counted = sum(spent - before.threads.get(thread, 0)
                      for thread, spent in after.items()) / 1e9
        rounding = 0.02 * max(self.processes, before.processes)
        return ticks if counted < ticks - rounding else counted


def thread_schedstat(pid: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Each thread of `pid` and its nanoseconds on a CPU and waiting for one so far; none
    where Linux does not give them (another system, or a process gone)."""
    found: dict[tuple[int, int], tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for thread in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{thread}/schedstat") as stat:
                    ran, waited = stat.read().split()[:2]
                    found[(pid, int(thread))] = (int(ran), int(waited))
    return found


@dataclass
class Side:
    """One path's figures over the interleaved rounds of one load."""

    runs: list[Run]
    cpu: float  # seconds of the path's process CPU over its rounds
    idle: float = 0.0  # the process's CPU per second with no traffic (its background)
    collections: int = 0  # the cycle collector's runs in the process over its rounds
    # Seconds its threads waited for a CPU over the rounds where that is known, and how
    # many events those rounds relayed.
    waited: float = 0.0
    waited_events: int = 0
    # Seconds of the process's CPU in each round (in the order of `runs`).
    round_cpu: list[float] = field(default_factory=list)
    # Each request's seconds in the project's gateway, its key known to its upstream
    # write (its usage records' queue_ms).
    held: list[float] = field(default_factory=list)
    # The engine's own gaps between the tokens it sent over the rounds (its
    # vllm:inter_token_latency_seconds): seconds summed and how many, where it was read.
    engine_gap_seconds: float = 0.0
    engine_gaps: int = 0

    @property
    def engine_itl_ms(self) -> float | None:
        """The engine's mean gap between two tokens of a stream over this path's rounds,
        in ms, as the engine measured it (None: not read). A paced engine waits one
        interval after each token it sends, so a late wake-up lengthens the stream."""
        return self.engine_gap_seconds / self.engine_gaps * 1e3 if self.engine_gaps else None

    @property
    def requests(self) -> int:
        """Requests answered over every round."""
        return sum(len(run.ttfts) for run in self.runs)

    @property
    def collections_per_100_requests(self) -> float:
        return self.collections / max(1, self.requests) * 100

    @property
    def events(self) -> int:
        """Events relayed over every round."""
        return sum(run.tokens for run in self.runs)

    @property
    def errors(self) -> int:
        return sum(run.errors for run in self.runs)

    @property
    def cpu_per_event_us(self) -> float:
        """Microseconds of the process's CPU per relayed event."""
        return self.cpu / max(1, self.events) * 1e6

    @property
    def waited_per_event_us(self) -> float | None:
        """Microseconds its threads waited for a CPU per relayed event (None: unknown)."""
        return self.waited / self.waited_events * 1e6 if self.waited_events else None

    @property
    def cpu_per_request_ms(self) -> float:
        """Milliseconds of the process's CPU per request answered."""
        return self.cpu / max(1, self.requests) * 1e3

    @property
    def net_cpu_per_event_us(self) -> float:
        """The same, less what the process burns with no traffic over as long."""
        seconds = sum(run.seconds for run in self.runs)
        return max(0.0, self.cpu - self.idle * seconds) / max(1, self.events) * 1e6

    @property
    def burst_cores(self) -> float:
        """Cores the whole machine kept busy, on average, from each round's start until
        every stream had its first token (the burst the TTFT is measured over)."""
        seconds = sum(run.burst_seconds for run in self.runs)
        return sum(run.burst_busy for run in self.runs) / seconds if seconds else 0.0

    @property
    def burst_ms(self) -> float:
        """The burst's mean length, in ms."""
        return sum(run.burst_seconds for run in self.runs) / max(1, len(self.runs)) * 1e3

    def legs(self, q: float) -> tuple[float, float, float] | None:
        """Each leg's percentile over every stamped request, in ms: to the engine, in it,
        and back to the client (None: the engine stamped nothing)."""
        legs = [leg for run in self.runs for leg in run.legs]
        if not legs:
            return None
        return tuple(Run([leg[i] for leg in legs], 0, 1, 0).p(q)  # type: ignore[return-value]
                     for i in range(3))

    def ttft(self, q: float) -> float:
        """A TTFT percentile over every round, in ms."""
        return Run([t for run in self.runs for t in run.ttfts], 0, 1, 0).p(q)

    def ttft_p50(self) -> float:
        return self.ttft(0.5)

    @property
    def rate(self) -> float:
        """Tokens per second over every round."""
        return sum(run.tokens for run in self.runs) / sum(run.seconds for run in self.runs)


def helpers_of(process: object) -> list[object]:
    """A relaying process's own children (the collector's parser), every level down, but
    not the replicas a control plane runs (they carry FLEETPLANE_REPLICA in their
    environment) nor anything below them: those are engines, not relaying."""
    import psutil

    assert isinstance(process, psutil.Process)
    found: list[object] = []
    with contextlib.suppress(psutil.Error):
        for child in process.children():
            with contextlib.suppress(psutil.Error):
                if "FLEETPLANE_REPLICA" not in child.environ():
                    found += [child, *helpers_of(child)]
    return found


def idle_burn(endpoints: list[Endpoint], seconds: float) -> dict[str, list[float]]:
    """Per model, each endpoint's process CPU per second while nothing is sent (one window
    for all)."""
    models = ("fake", "fast")
    before = {model: [endpoint.cpu_reading(model) for endpoint in endpoints]
              for model in models}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {model: [endpoint.cpu_reading(model).since(was) / elapsed
                    for endpoint, was in zip(endpoints, before[model], strict=True)]
            for model in models}


def engine_itl(url: str) -> tuple[float, int] | None:
    """An engine's inter-token latency so far, from its /metrics (vLLM's histogram
    vllm:inter_token_latency_seconds, every label set): seconds summed and gaps counted;
    None where it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    sums = {"vllm:inter_token_latency_seconds_sum": 0.0,
            "vllm:inter_token_latency_seconds_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums["vllm:inter_token_latency_seconds_sum"], int(
        sums["vllm:inter_token_latency_seconds_count"])


def interleave(load_: Load, endpoints: list[Endpoint], rounds: int,
               idle: list[float] | None = None,
               engines: dict[str, str] | None = None) -> list[Side]:
    """The same load sent to each endpoint in turn, `rounds` times, each round beginning
    one endpoint later (A, B, C, then B, C, A, then C, A, B ...: over a multiple of the
    endpoints' count of rounds each takes each place in the order as often, so none is
    always the one after a given other), each endpoint's process CPU counted over its own
    rounds only; with `engines` (model -> the engine's base URL), also the engine's own
    gaps between tokens over each endpoint's rounds."""
    warmed = now_as_stored()
    for endpoint in endpoints:  # warm connection pools at the measured concurrency
        asyncio.run(load(endpoint.urls[load_.model], load_.model, load_.streams, 8,
                         endpoint.key, 1))
    since = after_records((endpoint.database for endpoint in endpoints), warmed, load_.streams)
    sides = [Side([], 0.0, rate) for rate in idle or [0.0] * len(endpoints)]
    paired = list(zip(endpoints, sides, strict=True))
    for index in range(rounds):
        shift = index % len(paired)
        for endpoint, side in paired[shift:] + paired[:shift]:
            collected = endpoint.collections()
            engine = (engines or {}).get(load_.model)
            gaps = engine_itl(engine) if engine else None
            before = endpoint.cpu_reading(load_.model)
            run = asyncio.run(load(endpoint.urls[load_.model], load_.model, load_.streams,
                                   load_.tokens, endpoint.key, load_.requests))
            side.runs.append(run)
            after = endpoint.cpu_reading(load_.model)
            side.round_cpu.append(after.since(before))
            side.cpu += side.round_cpu[-1]
            waited = after.waited_since(before)
            if waited is not None:
                side.waited += waited
                side.waited_events += run.tokens
            side.collections += endpoint.collections() - collected
            gaps_after = engine_itl(engine) if engine and gaps is not None else None
            if gaps is not None and gaps_after is not None:
                side.engine_gap_seconds += gaps_after[0] - gaps[0]
                side.engine_gaps += gaps_after[1] - gaps[1]
    for endpoint, side in paired:
        side.held = held_in(endpoint.database, since, rounds * load_.streams * load_.requests)
    return sides


ROUTER = "vllm-router"
BARE = "bare Python relay"  # bench/bare_relay.py: a floor, judged against nothing


def print_rows(load_: Load, endpoints: list[Endpoint], sides: list[Side], rounds: int) -> None:
    """One line per path as each load finishes, so a long run shows progress."""
    direct = sides[0]
    for endpoint, side in zip(endpoints, sides, strict=True):
        print(f"{load_.name} ({load_.streams} x {load_.requests} x {load_.tokens} tokens, "
              f"{rounds} rounds) {endpoint.name}: TTFT p50 {side.ttft(0.5):.2f} p99 "
              f"{side.ttft(0.99):.2f} ms, {side.rate:,.0f} tok/s, ratio "
              f"{side.rate / direct.rate:.3f}, "
              + (f"{side.cpu_per_event_us:.1f} us CPU/event "
                 f"({side.net_cpu_per_event_us:.1f} net of idle), " if endpoint.pids else "")
              + (f"waited {side.waited_per_event_us:.1f} us/event for a CPU, "
                 if side.waited_per_event_us is not None else "")
              + legs_text(side)
              + (f"engine ITL {side.engine_itl_ms:.3f} ms, "
                 if side.engine_itl_ms is not None else "")
              + f"burst {side.burst_ms:.1f} ms with the machine {side.burst_cores:.2f} of "
              f"{os.cpu_count()} cores busy, errors {side.errors}", flush=True)


def legs_text(side: Side) -> str:
    """Where the first token's time went, p50 and p90 of each leg, or nothing where the
    engine stamped no event."""
    p50, p90 = side.legs(0.5), side.legs(0.9)
    if p50 is None or p90 is None:
        return ""
    held = (" (in the gateway {:.1f}/{:.1f})".format(*(Run(side.held, 0, 1, 0).p(q)
                                                       for q in (0.5, 0.9))) if side.held else "")
    return ("legs p50/p90: to engine {:.1f}/{:.1f}" + held + ", in engine {:.1f}/{:.1f}, "
            "back {:.1f}/{:.1f} ms, ").format(*(v for pair in zip(p50, p90, strict=True)
                                                 for v in pair))


def print_table(results: list[tuple[Load, list[Endpoint], list[Side]]], rounds: int) -> None:
    """The markdown table, then the targets (each gateway path against the router, same
    run)."""
    print(f"\n{rounds} interleaved rounds per load; added TTFT is the path's percentile "
          f"minus the direct one; CPU per relayed event is the path's process (every "
          f"thread's time on a CPU, children included, by the scheduler's count) over its "
          f"own rounds; net: less its CPU with no traffic over as long.\n")
    print("| load | path | TTFT p50 / p99 | added TTFT p50 / p99 | tokens/s | ratio | "
          "CPU per event (net) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    # Per gateway path, per target, the rows that miss it.
    misses: dict[str, dict[str, list[str]]] = {}
    for load_, endpoints, sides in results:
        direct = sides[0]
        for endpoint, side in zip(endpoints, sides, strict=True):
            added = (f"{side.ttft(0.5) - direct.ttft(0.5):+.1f} / "
                     f"{side.ttft(0.99) - direct.ttft(0.99):+.1f} ms"
                     if endpoint.name != "direct" else "")
            cpu = (f"{side.cpu_per_event_us:.1f} µs ({side.net_cpu_per_event_us:.1f})"
                   if endpoint.pids else "")
            print(f"| {load_.name} | {endpoint.name} | {side.ttft(0.5):.1f} / "
                  f"{side.ttft(0.99):.1f} ms | {added} | {side.rate:,.0f} | "
                  f"{side.rate / direct.rate:.3f} | {cpu} | {side.errors} |")
        names = [endpoint.name for endpoint in endpoints]
        if ROUTER not in names:
            continue
        router = sides[names.index(ROUTER)]
        for endpoint, side in zip(endpoints[1:], sides[1:], strict=True):
            if endpoint.name not in (ROUTER, BARE):
                check_targets(load_.name, direct, side, router, misses.setdefault(
                    endpoint.name, {"ttft": [], "ratio": [], "cpu": []}))
    print()
    if not misses:
        print("targets: not judged (no vllm-router in this run)")
        return
    rows = len(results)
    for path, missed in misses.items():
        for key, text in (("ttft", "added TTFT p50 within the router's + 2 ms on every row"),
                          ("ratio", "throughput ratio at least the router's on every row"),
                          ("cpu", "CPU per relayed event at most the router's on every row")):
            verdict = "MISSED" if missed[key] else "met"
            detail = "; ".join(missed[key]) if missed[key] else f"{rows} of {rows} rows"
            print(f"target ({path}): {text}: {verdict} ({detail})")


def profile_load(text: str) -> Load:
    """`--profile-load (paced|unpaced)-STREAMS[xTOKENS]`, e.g. paced-128 or unpaced-128x1."""
    match = re.fullmatch(r"(paced|unpaced)-(\d+)(?:x(\d+))?", text.strip())
    if not match or int(match.group(2)) < 1 or int(match.group(3) or 256) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected paced-N or unpaced-N, "
                                         f"optionally xTOKENS (e.g. unpaced-128x1)")
    paced, streams, tokens = match.group(1) == "paced", int(match.group(2)), int(
        match.group(3) or 256)
    # A round of about a second or more, so the unsampled figure is not a few ms long.
    requests = 1 if paced else max(1, 256 * 64 * 8 // (streams * tokens))
    requests = min(requests, max(1, 4096 // streams))
    return Load(text, "paced 10 ms/token" if paced else "unpaced", "fake" if paced else "fast",
                streams, requests, tokens)


def load_names(text: str) -> list[str]:
    """`--loads paced-128,unpaced-64`: names from LOADS, or any load --profile-load takes,
    e.g. unpaced-128x1 or paced-128x1 (a burst of first tokens alone); refused otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOADS
               and not re.fullmatch(r"(paced|unpaced)-\d+(x\d+)?", name)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown load {', '.join(unknown) or text!r}; "
                                         f"known: {', '.join(LOADS)}, or (paced|unpaced)-"
                                         f"STREAMS[xTOKENS]")
    return names
