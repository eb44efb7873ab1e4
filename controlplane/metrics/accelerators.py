"""The accelerator figures of each replica: DCGM exporter figures when DCGM_EXPORTER_URL
is set, else NVML for local GPUs, else the replica's processes' CPU and memory (psutil),
labelled "cpu"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from controlplane.metrics.targets import Target

logger = logging.getLogger(__name__)

#: How long a replica's process group (its pid and children) is taken as known.
GROUP_REFRESH_SECONDS = 30.0

DCGM = {
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
}


def cpu_figures(pids: Iterable[int], cache: dict[int, Any]) -> dict[str, Any]:
    """CPU percent (of one core) and resident memory of a replica's process group."""
    import psutil

    cpu = 0.0
    rss = 0
    seen = False
    for pid in pids:
        try:
            process = cache.get(pid)
            if process is None:
                process = cache[pid] = psutil.Process(pid)
                process.cpu_percent(None)  # the first call only starts the measurement
            cpu += process.cpu_percent(None)
            rss += process.memory_info().rss
            seen = True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            cache.pop(pid, None)
    if not seen:
        return {"accelerator": "cpu"}
    return {"accelerator": "cpu", "cpu_percent": round(cpu, 1),
            "memory_mib": round(rss / 2**20, 1)}


def process_group(pid: int) -> list[int]:
    """The replica's process and its children (vLLM's engine core is a child)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        return [pid] + [child.pid for child in parent.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class ProcessGroups:
    """Each replica's process group, looked up again every GROUP_REFRESH_SECONDS or when
    one of its processes has gone: finding children reads every process of the machine
    (/proc), which every pass for every replica made the largest part of an idle
    collector's time, while a replica's processes are started once, before it is ready."""

    def __init__(self, refresh: float = GROUP_REFRESH_SECONDS) -> None:
        self.refresh = refresh
        self.groups: dict[int, tuple[list[int], float]] = {}

    def of(self, pid: int, now: float | None = None) -> list[int]:
        """The pids of `pid`'s group (itself first), fresh within `refresh` seconds."""
        now = time.monotonic() if now is None else now
        known = self.groups.get(pid)
        if known is not None and now - known[1] < self.refresh and all(
                pid_alive(member) for member in known[0]):
            return known[0]
        group = process_group(pid)
        self.groups[pid] = (group, now)
        return group

    def keep_only(self, pids: set[int]) -> None:
        """Forget the groups of replicas no longer scraped."""
        for gone in set(self.groups) - pids:
            del self.groups[gone]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one stat of /proc, no scan)."""
    return os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True


class Nvml:
    """Local GPUs through NVML (the nvidia-ml-py package), when it loads."""

    def __init__(self) -> None:
        self.ready = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.ready = self.count > 0
        except Exception:
            self.ready = False

    def figures(self, pids: set[int]) -> dict[str, Any] | None:
        """The GPUs running any of these processes, summed (utilisation averaged)."""
        if not self.ready:
            return None
        nvml = self.nvml
        used = free = power = 0.0
        utils: list[float] = []
        temps: list[float] = []
        for index in range(self.count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            running = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            if not running & pids:
                continue
            utils.append(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used += memory.used / 2**20
            free += memory.free / 2**20
            with contextlib.suppress(Exception):
                power += nvml.nvmlDeviceGetPowerUsage(handle) / 1000
            with contextlib.suppress(Exception):
                temps.append(nvml.nvmlDeviceGetTemperature(handle, 0))
        if not utils:
            return None
        return {"accelerator": "gpu", "gpu_util": round(sum(utils) / len(utils), 1),
                "mem_used_mib": round(used), "mem_free_mib": round(free),
                "power_w": round(power, 1), "temperature_c": max(temps) if temps else None}


def parse_dcgm(text: str) -> dict[str, dict[str, float]]:
    """DCGM exporter figures keyed by the pod (Kubernetes) or the host, else "gpu<N>"."""
    out: dict[str, dict[str, float]] = {}
    kept = "\n".join(line for line in text.splitlines()
                     if line.startswith(tuple(DCGM)) or line.startswith("# TYPE DCGM_"))
    for family in text_string_to_metric_families(kept + "\n"):
        key = DCGM.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            owner = (labels.get("pod") or labels.get("exported_pod")
                     or labels.get("Hostname") or f"gpu{labels.get('gpu', '?')}")
            out.setdefault(owner, {})[key] = sample.value
    return out


class Accelerators:
    """Reads the accelerator figures of each pass; keeps what NVML and psutil need
    between passes (the NVML handle, the processes measured)."""

    def __init__(self) -> None:
        self.processes: dict[int, Any] = {}
        self.groups = ProcessGroups()
        self.nvml: Nvml | None = None

    async def figures(self, targets: list[Target],
                      fetch: Callable[[str, str], Awaitable[str]]
                      ) -> dict[str, dict[str, Any]]:
        """Per replica name, its accelerator figures; `fetch(url, path)` reads the DCGM
        exporter."""
        out: dict[str, dict[str, Any]] = {}
        if settings.DCGM_EXPORTER_URL:
            try:
                base, _, path = str(settings.DCGM_EXPORTER_URL).partition("://")
                host, _, rest = path.partition("/")
                by_owner = parse_dcgm(await fetch(f"{base}://{host}", "/" + rest))
            except Exception as exc:
                logger.debug("DCGM exporter scrape failed: %s", exc)
                by_owner = {}
            for target in targets:
                figures = by_owner.get(target.name)
                if figures:
                    out[target.name] = {"accelerator": "gpu", **figures}
            if by_owner:
                return out
        local = [t for t in targets if t.local and t.pid]
        if not local:
            return out
        if self.nvml is None:
            self.nvml = await asyncio.to_thread(Nvml)
        self.groups.keep_only({t.pid for t in local if t.pid})
        groups = {t.name: self.groups.of(t.pid) for t in local if t.pid}
        for target in local:
            pids = groups.get(target.name) or []
            gpu = self.nvml.figures(set(pids)) if self.nvml.ready else None
            out[target.name] = gpu or cpu_figures(pids, self.processes)
        return out
