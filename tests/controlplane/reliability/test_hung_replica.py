"""A hung replica is noticed: one of two local replicas (FAKE engines: fakes/vllm_cli.py)
is stopped with SIGSTOP while 16 clients stream through the gateway. Its socket stays open,
so only silence tells: the gateway's idle limit (GATEWAY_UPSTREAM_IDLE_SECONDS) ends its
streams with an SSE error and sends what it holds elsewhere, and the reconciler's /health
probe has it killed and restarted (docs/deployments.md, "A replica's life")."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.controlplane.reliability.traffic import running_fleet
from tests.processes import wait_until

pytestmark = pytest.mark.slow

IDLE = 3  # GATEWAY_UPSTREAM_IDLE_SECONDS
HEALTH_FAILURE = 4  # HEALTH_FAILURE_SECONDS
PROBE_TIMEOUT = 5  # the local backend's /health probe
RESTART_BACKOFF = 5  # the first restart's delay


def test_a_stopped_replica_is_routed_around_its_streams_end_cleanly_and_it_is_restarted(
        tmp_path: Path) -> None:
    with running_fleet(tmp_path, 25, GATEWAY_UPSTREAM_IDLE_SECONDS=str(IDLE),
                       HEALTH_FAILURE_SECONDS=str(HEALTH_FAILURE),
                       HEALTH_RECORD_SECONDS="1") as fleet:
        fleet.deploy("chat", 2)
        traffic = fleet.traffic("chat", max_tokens=100).start()  # 2.5 s streams
        hung = fleet.replicas("chat")[0]
        try:
            wait_until("streams on both replicas", lambda: all(
                fleet.engine_running(r) > 0 for r in fleet.replicas("chat")), 30)
            os.kill(hung["pid"], signal.SIGSTOP)
            stopped_at = time.monotonic()
            traffic.label = "hung"
            restarted = wait_until("the hung replica killed, restarted and ready", lambda: [
                r for r in fleet.replicas("chat") if r["name"] == hung["name"]
                and r["pid"] != hung["pid"] and r["phase"] == "ready"], 60)[0]
            back_after = time.monotonic() - stopped_at
            traffic.wait_for_answers(16, "hung")
        finally:
            outcomes = traffic.stop()
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung["pid"], signal.SIGCONT)
    # Its streams ended with an SSE error once it had been silent IDLE seconds.
    cut = [o for o in outcomes if not o.ok]
    assert cut, "no stream was running on the stopped replica"
    assert [o for o in cut if not (o.clean_error_event and o.label == "steady")] == []
    assert max(o.ended for o in cut) - stopped_at < IDLE + 5
    # Every request that began after the stop was answered (by the other replica).
    assert [o for o in outcomes if o.label == "hung" and not o.ok] == []
    # The reconciler killed it (SIGKILL works on a stopped process) and started it again.
    assert not psutil.pid_exists(hung["pid"]) or psutil.Process(
        hung["pid"]).status() == psutil.STATUS_ZOMBIE
    assert restarted["restart_count"] == 1
    assert back_after < HEALTH_FAILURE + PROBE_TIMEOUT + RESTART_BACKOFF + 20
