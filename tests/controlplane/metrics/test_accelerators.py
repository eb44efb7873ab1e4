"""Accelerator figures: the DCGM exporter's, keyed by pod."""

from __future__ import annotations

from controlplane.metrics.accelerators import parse_dcgm


def test_dcgm_figures_are_keyed_by_pod() -> None:
    figures = parse_dcgm(
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n1",pod="demo-1"} 87\n'
        "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1",pod="demo-1"} 70000\n')
    assert figures == {"demo-1": {"gpu_util": 87.0, "mem_used_mib": 70000.0}}
