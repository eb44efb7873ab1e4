"""The reconcile pass: over every deployment (a full pass), or only over those with work
to do (controlplane/reconciler/schedule.py), each handed to the reconciler of its
backend's kind (`ReplicaReconciler` or `PodSetReconciler`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from controlplane.backends.base import PodSetBackend, ReplicaBackend, backend_for
from controlplane.models import Deployment
from controlplane.reconciler.pod_sets import PodSetReconciler
from controlplane.reconciler.replicas import ReplicaReconciler
from controlplane.reconciler.schedule import PassSchedule, note_fleet_changed, settled

logger = logging.getLogger(__name__)


@dataclass
class PassResult:
    """What one pass did: deployments seen, how many changed, its duration, its errors,
    and whether it visited every deployment."""

    deployments: int = 0
    changed: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    full: bool = True


class Reconciler:
    """Level-triggered: each pass reads desired and observed state and converges. What it
    keeps between passes only paces probes, backs off, tells events once and says which
    deployments have work to do (`schedule`); everything else is read again on each
    pass, and a full pass reads everything at least every RECONCILE_RESYNC_SECONDS."""

    def __init__(self, progress: Callable[[str], None] | None = None) -> None:
        self.replicas = ReplicaReconciler()
        self.pod_sets = PodSetReconciler()
        self.schedule = PassSchedule()
        # Told after each deployment: a pass over a large fleet is progress, step by step,
        # to the liveness check and the Lease (controlplane/liveness.py).
        self.progress = progress

    @property
    def last_probe(self) -> dict[int, float]:
        """When each ready replica's health was last probed (monotonic seconds)."""
        return self.replicas.last_probe

    def reconcile_all(self) -> PassResult:
        """One pass over every deployment; one deployment's failure does not stop it."""
        self.schedule.starting_full()
        deployments = list(Deployment.objects.select_related("model", "backend")
                           .prefetch_related("replica_set"))
        if not self.replicas.orphans_checked:
            self.replicas.cleanup_orphans(deployments)
        return self._reconcile(deployments, full=True)

    def reconcile_changed(self, *, requested: bool = False) -> PassResult:
        """A full pass when something may have changed (asked for, an event seen, the
        resync due); otherwise a pass over only the deployments with work to do, which
        reads nothing more when there is none."""
        if self.schedule.full_due(requested):
            return self.reconcile_all()
        due = self.schedule.due()
        if not due:
            return PassResult(full=False)
        deployments = list(Deployment.objects.filter(pk__in=due)
                           .select_related("model", "backend").prefetch_related("replica_set"))
        for gone in due - {d.pk for d in deployments}:
            self.schedule.forget(gone)
        return self._reconcile(deployments, full=False)

    def _reconcile(self, deployments: list[Deployment], *, full: bool) -> PassResult:
        started = time.perf_counter()
        result = PassResult(full=full)
        self.pod_sets.refresh(deployments)
        self.replicas.observe_all(deployments)
        for deployment in deployments:
            result.deployments += 1
            try:
                if self.reconcile_deployment(deployment):
                    result.changed += 1
            except Exception as exc:  # one deployment's failure must not stop the others
                logger.exception("reconciling %s failed", deployment.name)
                result.errors.append(f"{deployment.name}: {exc}")
                self.schedule.note(deployment.pk, False, 0.0)
            if self.progress is not None:
                self.progress(f"reconciled {deployment.name}")
        self.replicas.record_health()
        if full or result.changed:
            note_fleet_changed()
        result.seconds = time.perf_counter() - started
        return result

    def reconcile_deployment(self, deployment: Deployment) -> bool:
        """Converge one deployment through the reconciler of its backend's kind."""
        chosen = backend_for(deployment.backend)
        replicas = list(deployment.replica_set.all())
        if chosen.owns_pods:
            changed = self.pod_sets.reconcile(deployment, cast(PodSetBackend, chosen),
                                              replicas)
        else:
            changed = self.replicas.reconcile(deployment, cast(ReplicaBackend, chosen),
                                              replicas)
        calm = settled(deployment, replicas, changed=changed,
                       creates_replicas=chosen.creates_replicas, owns_pods=chosen.owns_pods)
        self.schedule.note(deployment.pk, calm, min(
            (self.replicas.pacer.next_at(r, chosen.creates_replicas) for r in replicas),
            default=float("inf")))
        return changed
