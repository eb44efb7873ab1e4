"""Accelerator figures: the DCGM exporter's, keyed by pod; local replicas' process groups."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controlplane.metrics.accelerators import parse_dcgm


def test_dcgm_figures_are_keyed_by_pod() -> None:
    figures = parse_dcgm(
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n1",pod="demo-1"} 87\n'
        "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1",pod="demo-1"} 70000\n')
    assert figures == {"demo-1": {"gpu_util": 87.0, "mem_used_mib": 70000.0}}


def test_a_replicas_process_group_is_looked_up_once_per_refresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.metrics import accelerators

    groups = accelerators.ProcessGroups(refresh=30.0)
    looked_up: list[int] = []
    real = accelerators.process_group

    def counting(pid: int) -> list[int]:
        looked_up.append(pid)
        return real(pid)

    monkeypatch.setattr(accelerators, "process_group", counting)
    me = os.getpid()
    first = groups.of(me, now=100.0)
    again = groups.of(me, now=110.0)  # within the refresh: no scan of /proc
    later = groups.of(me, now=131.0)  # past it: looked up again
    assert first == again == later and first[0] == me
    assert looked_up == [me, me]


def test_a_group_with_a_process_gone_is_looked_up_again_at_once() -> None:
    from controlplane.metrics.accelerators import ProcessGroups

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        groups = ProcessGroups(refresh=3600.0)
        assert child.pid in groups.of(os.getpid(), now=0.0)
    finally:
        child.kill()
        child.wait(timeout=15)
    assert child.pid not in groups.of(os.getpid(), now=1.0)
