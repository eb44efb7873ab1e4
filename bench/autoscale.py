"""Autoscaling with and without a warm standby, on the local backend with real vLLM CPU
replicas of the demo model (min 1, max 2): a step from nothing to 32 concurrent streams.

For each case (standby 1, then standby 0; with --runs N the two alternate, run by run)
the control plane runs as `manage.py serve`
(reconciler, collector every 2 s, autoscaler, gateway); the policy scales on the gateway's
requests in flight per replica (target 8: 32 streams ask for 4, bounded to 2). Measured:
the time from the step to the scale-up decision (the `autoscaled` event), from the
decision to the second replica serving (its own request counter moving under short probe
requests sent through the gateway every 0.25 s from the decision on), and the TTFT of
the streams during the step.

    .venv/bin/python bench/autoscale.py [--streams 32] [--only standby|cold] [--runs N]
                                        [--cores-per-replica N]

With --cores-per-replica the replicas run on a local backend that gives each its own
cores (`cpu_cores_per_replica`), as a CPU fleet would be laid out: the promoted standby
then has a core the loaded replica does not use.

Targets: the decision within 2 scrape intervals (4 s); with a standby, serving under 1 s
after the decision. The last line prints the standby case's decision-to-serving times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.planes import ControlPlane  # noqa: E402
from models_registry.demo import DEMO_MODEL_NAME  # noqa: E402
from tests.processes import end_replicas, manage, stop_server  # noqa: E402

SCRAPE = 2.0
POLICY = {"signals": [{"name": "queue_per_replica", "target": 8}],
          "scale_down_window_seconds": 600, "cooldown_seconds": 0}


def api_get(product: ControlPlane, path: str, **params: Any) -> Any:
    response = httpx.get(product.url + path, params=params, timeout=30,
                         headers={"Authorization": f"Bearer {product.admin}"})
    response.raise_for_status()
    return response.json()


def wait(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def replicas(product: ControlPlane, name: str) -> list[dict[str, Any]]:
    return list(api_get(product, f"/api/v1/deployments/{name}/")["replica_list"])


def served(endpoint: str) -> float:
    """The replica's finished plus running requests (it serves once this moves)."""
    text = httpx.get(f"{endpoint}/metrics", timeout=2).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:request_success_total", "vllm:num_requests_running")):
            total += float(line.rsplit(" ", 1)[-1])
    return total


async def load(url: str, key: str, model: str, streams: int, seconds: float,
               ttfts: list[float], done: threading.Event) -> None:
    """Streams until `done` is set (the second replica serves, plus a while) or `seconds`
    have passed."""
    body = {"model": model, "stream": True, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}
    deadline = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and not done.is_set():
            started = time.monotonic()
            first = None
            try:
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"}) as reply:
                    async for line in reply.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.monotonic() - started
            except httpx.HTTPError:
                continue
            if first is not None:
                ttfts.append(first)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(
            max_connections=streams + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(streams)))


def case(product: ControlPlane, name: str, standby: int, streams: int,
         backend: str = "local") -> dict[str, float]:
    response = httpx.post(product.url + "/api/v1/deployments/", timeout=30, headers={
        "Authorization": f"Bearer {product.admin}"}, json={
        "name": name, "model": DEMO_MODEL_NAME, "backend": backend, "replicas": 1,
        "min_replicas": 1,
        "max_replicas": 2, "standby": standby, "autoscaling": POLICY,
        "engine_args": {"max_model_len": 1024, "extra_args": ["--enforce-eager"]}})
    if response.status_code != 201:
        raise SystemExit(f"creating {name}: {response.text}")
    wait(f"{name} ready ({1 + standby} replicas)", lambda: sum(
        1 for r in replicas(product, name) if r["phase"] == "ready") == 1 + standby, 900, 2)
    time.sleep(3 * SCRAPE)  # the collector has figures for the idle deployment
    initial = replicas(product, name)
    before = {r["name"] for r in initial if r["role"] == "active"}
    # The standby's counter now (its warm-up request counted): serving is a rise above it.
    baseline = {r["name"]: served(r["endpoint"]) for r in initial if r["name"] not in before}
    ttfts: list[float] = []
    seconds = 900.0  # at most; the streams go on until the second replica serves + 30 s
    done = threading.Event()
    step = time.time()
    print(f"{name}: {streams} streams from {datetime.fromtimestamp(step):%H:%M:%S}")
    outcome: dict[str, float] = {}

    # A standby's endpoint is known before the step, and outside routing it serves
    # nothing: its own request counter is read every 0.1 s from the step on (more often
    # would load the replica being measured), so the first request it serves is timed
    # however slowly the loaded control plane's API answers the benchmark's other
    # questions; the probe below tightens it when the probe is that request.
    standbys = {r["name"]: r["endpoint"] for r in initial if r["name"] not in before}
    first_served: list[float] = []

    def watch_standby() -> None:
        while not done.is_set() and not first_served:
            with contextlib.suppress(httpx.HTTPError):
                if any(served(endpoint) > baseline[replica]
                       for replica, endpoint in standbys.items()):
                    first_served.append(time.time())
            time.sleep(0.1)

    if standbys:
        threading.Thread(target=watch_standby, daemon=True).start()

    def watch() -> None:
        def decision() -> dict[str, Any] | None:
            events = api_get(product, "/api/v1/events/", deployment=name)
            return next((e for e in events.get("results", events) if e["action"] ==
                         "autoscaled" and (e.get("after") or {}).get("result") == 2), None)

        event = wait("the scale-up decision", decision, 60, 0.2)
        decided = datetime.fromisoformat(event["at"]).timestamp()
        outcome["decision_s"] = decided - step
        print(f"  decision {outcome['decision_s']:.2f} s after the step: {event['message']}")

        # The streams are a closed loop: with 32 long streams on one CPU replica a new
        # request comes only when an old one ends, and requests sent before the promotion
        # queue behind them. So one short probe goes through the gateway (least-load
        # routing sends it to the idle replica): at once with a standby, the moment the new
        # replica is seen active without one; the replica serves when its request counter
        # moves.
        promoted: dict[str, float] = {}
        probes: list[threading.Thread] = []

        def probe() -> None:
            sent = time.time()
            with contextlib.suppress(httpx.HTTPError):
                reply = httpx.post(f"{product.url}/v1/chat/completions", timeout=300, json={
                    "model": name, "max_tokens": 1, "messages": [
                        {"role": "user", "content": "Hi"}]},
                    headers={"Authorization": f"Bearer {product.key}"})
                if reply.status_code == 200:
                    answered = time.time()
                    outcome["probe_sent_after_decision_s"] = sent - decided
                    outcome["probe_answered_s"] = answered - sent
                    if standbys and any(served(endpoint) > baseline[replica]
                                        for replica, endpoint in standbys.items()):
                        # The standby has served by the time the probe is answered.
                        first_served.append(answered)
                        first_served.sort()

        if standbys:  # the probe leaves at once: the standby is promoted in this pass
            promoted["seen"] = time.time()
            probes.append(threading.Thread(target=probe, daemon=True))
            probes[-1].start()

        def standby_serving() -> bool:
            return bool(first_served)

        def second_serving() -> bool:
            for replica in replicas(product, name):
                if replica["name"] in before or replica["phase"] != "ready":
                    continue
                if replica["name"] not in baseline:  # a new one: count from its warm-up
                    baseline[replica["name"]] = served(replica["endpoint"])
                    continue
                if replica["role"] != "active":
                    continue
                if not promoted:
                    promoted["seen"] = time.time()
                    probes.append(threading.Thread(target=probe, daemon=True))
                    probes[-1].start()
                if served(replica["endpoint"]) > baseline[replica["name"]]:
                    return True
            return False

        wait("the second replica serving", standby_serving if standbys else second_serving,
             900, 0.02)
        served_at = first_served[0] if first_served else time.time()
        for thread in probes:
            thread.join(60)
        events = api_get(product, "/api/v1/events/", deployment=name)
        promotion = next((e for e in events.get("results", events)
                          if e["action"] in ("replica-promoted", "replica-ready")
                          and e["replica_name"] not in before
                          and datetime.fromisoformat(e["at"]).timestamp() >= decided - 1),
                         None)
        if promotion is not None:
            at = datetime.fromisoformat(promotion["at"]).timestamp()
            outcome["promotion_s"] = at - decided
            outcome["promotion_to_served_s"] = served_at - at
        outcome["serving_s"] = served_at - decided
        time.sleep(30)  # the step goes on a little with both replicas serving
        done.set()
        print(f"  second replica serving {outcome['serving_s']:.2f} s after the decision")

    async def both() -> None:
        try:
            await asyncio.gather(load(product.url, product.key, name, streams, seconds,
                                      ttfts, done), asyncio.to_thread(watch))
        finally:
            done.set()

    asyncio.run(both())
    ttfts.sort()
    outcome["ttft_p95_s"] = ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else float("nan")
    outcome["ttft_p50_s"] = statistics.median(ttfts) if ttfts else float("nan")
    outcome["requests"] = len(ttfts)
    httpx.post(product.url + f"/api/v1/deployments/{name}/stop/", timeout=30,
               headers={"Authorization": f"Bearer {product.admin}"})
    wait(f"{name} stopped", lambda: not replicas(product, name), 120, 1)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--only", choices=("standby", "cold"), default="")
    parser.add_argument("--runs", type=int, default=1, help="runs of each case, alternated")
    parser.add_argument("--cores-per-replica", type=int, default=0, metavar="N",
                        help="run the replicas on a local backend that binds N cores to "
                             "each (cpu_cores_per_replica), instead of letting them share")
    options = parser.parse_args()
    product = ControlPlane(SCRAPE_INTERVAL=str(SCRAPE), RECONCILE_INTERVAL_SECONDS="0.5",
                      HEALTH_CHECK_SECONDS="2", LOCAL_KV_CACHE_GIB="1")
    try:
        print("importing the demo model ...")
        manage(product.env, "import_demo_model")
        backend = "local"
        if options.cores_per_replica:
            backend = "bound"
            response = httpx.post(product.url + "/api/v1/backends/", timeout=30, headers={
                "Authorization": f"Bearer {product.admin}"}, json={
                "name": backend, "kind": "local", "config": {
                    "cpu_cores_per_replica": options.cores_per_replica, "kv_cache_gib": 1}})
            if response.status_code != 201:
                raise SystemExit(f"creating the backend: {response.text}")
        results: list[tuple[str, dict[str, float]]] = []
        cases = [("standby", 1), ("cold", 0)]
        cases = [(label, standby) for label, standby in cases if options.only in ("", label)]
        # With both cases, they alternate run by run (standby, cold, standby, cold ...),
        # so both see the same machine.
        for run in range(1, options.runs + 1):
            for label, standby in cases:
                name = f"{'warm' if standby else 'cold'}-{run}"
                figures = case(product, name, standby, options.streams, backend)
                results.append((label, figures))
                print(f"{'with' if standby else 'without'} a standby (run {run}): {figures}")
        for label, figures in results:
            steps = (f", of which decision -> promoted/ready {figures['promotion_s']:.2f} s "
                     f"and then -> serving {figures['promotion_to_served_s']:.2f} s"
                     if "promotion_s" in figures else "")
            if "probe_answered_s" in figures:
                steps += (f"; a request sent {figures['probe_sent_after_decision_s']:.2f} s "
                          f"after the decision was answered in "
                          f"{figures['probe_answered_s']:.2f} s")
            print(f"{label}: step -> decision {figures['decision_s']:.2f} s, decision -> "
                  f"serving {figures['serving_s']:.2f} s{steps}; streams' TTFT p50 "
                  f"{figures['ttft_p50_s']:.2f} s, p95 {figures['ttft_p95_s']:.2f} s "
                  f"({figures['requests']:.0f} requests)")
        warm = [figures["serving_s"] for label, figures in results if label == "standby"]
        if warm:
            print("scale-up with a warm standby: decision -> serving "
                  + ", ".join(f"{seconds:.2f}" for seconds in warm) + " s")
    finally:
        stop_server(product.process)
        end_replicas(product.env["DATA_DIR"])


if __name__ == "__main__":
    main()
