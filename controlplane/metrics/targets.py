"""What the collector scrapes: every live replica (ready or draining, with an endpoint),
read from the database, with the key its /metrics wants; and each deployment's counts.
Read again only when the reconciler may have changed them (`TargetCache`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from serving.sealing import SealError, unseal


@dataclass
class Target:
    """One replica to scrape."""

    name: str
    deployment: str
    url: str
    role: str
    phase: str
    pid: int | None
    local: bool
    #: Sent as `Authorization: Bearer` (the engine key; an external endpoint's own key).
    key: str = field(default="", repr=False)


def scrape_key(kind: str, config: dict[str, Any] | None, sealed: str) -> str:
    """The bearer token a replica's /metrics wants (Deployment.upstream_key, from the
    columns a values() query read)."""
    if kind == "external":
        return str((config or {}).get("api_key") or "")
    try:
        return unseal(sealed)
    except SealError:
        return ""


def load_targets() -> tuple[list[Target], dict[str, dict[str, int]]]:
    """The live replicas, and per deployment its desired, ready and standby counts."""
    from django.db import close_old_connections

    from controlplane.models import Deployment, Replica

    close_old_connections()
    deployments = {d.name: {"desired": d.desired_replicas(), "ready": 0, "standby": 0}
                   for d in Deployment.objects.filter(deleting=False)}
    targets = []
    keys: dict[str, str] = {}
    live = (Replica.Phase.READY, Replica.Phase.DRAINING)
    for row in Replica.objects.filter(phase__in=live).exclude(endpoint="").values(
            "name", "deployment__name", "endpoint", "role", "phase", "pid",
            "deployment__backend__kind", "deployment__backend__config",
            "deployment__engine_key_sealed"):
        deployment = row["deployment__name"]
        counts = deployments.setdefault(deployment, {"desired": 0, "ready": 0,
                                                     "standby": 0})
        if row["phase"] == Replica.Phase.READY:
            counts["standby" if row["role"] == "standby" else "ready"] += 1
        if deployment not in keys:
            keys[deployment] = scrape_key(row["deployment__backend__kind"],
                                          row["deployment__backend__config"],
                                          row["deployment__engine_key_sealed"])
        targets.append(Target(row["name"], deployment, row["endpoint"], row["role"],
                              row["phase"], row["pid"],
                              row["deployment__backend__kind"] == "local",
                              keys[deployment]))
    return targets, deployments


Targets = tuple[list[Target], dict[str, dict[str, int]]]


class TargetCache:
    """The targets, read again only after a reconcile pass of this process that was full
    or changed something (every change to deployments or replicas leads to one), and at
    least every RECONCILE_RESYNC_SECONDS; every time unless the reconciler runs beside
    it (`follows_reconciler`: the controllers' collector). An idle fleet of 300
    deployments spent a tenth of a core reading them every scrape
    (bench/fleet_scale.py)."""

    def __init__(self, follows_reconciler: bool = False) -> None:
        self.follows_reconciler = follows_reconciler
        self.revision = -1
        self.read_at = 0.0
        self.targets: Targets | None = None

    def kept(self) -> Targets | None:
        """The targets read last, while they need not be read again; else None. Reads
        nothing (the event loop calls it, and goes to a thread for `load` only on None)."""
        from controlplane.reconciler.schedule import fleet_revision

        revision = fleet_revision()
        if (self.targets is None or not self.follows_reconciler or revision == 0
                or revision != self.revision
                or time.monotonic() - self.read_at >= settings.RECONCILE_RESYNC_SECONDS):
            return None
        return self.targets

    def load(self) -> Targets:
        """The current targets (a thread may call this: it reads the database)."""
        from controlplane.reconciler.schedule import fleet_revision

        kept = self.kept()
        if kept is not None:
            return kept
        revision, now = fleet_revision(), time.monotonic()
        self.targets = load_targets()
        self.revision, self.read_at = revision, now
        return self.targets
