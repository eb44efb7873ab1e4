"""The reconcile pass: over every deployment (a full pass), or only over those with work
to do (controlplane/reconciler/schedule.py), each handed to the reconciler of its
backend's kind (`ReplicaReconciler` or `PodSetReconciler`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from controlplane.backends.base import Observation, PodSetBackend, ReplicaBackend, backend_for
from controlplane.models import Deployment, Replica
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
        #: Settled deployments as their last visit read them (with their replicas).
        self.settled: dict[int, tuple[Deployment, list[Replica]]] = {}
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
        self.settled.clear()
        deployments = list(Deployment.objects.select_related("model", "backend")
                           .prefetch_related("replica_set"))
        if not self.replicas.orphans_checked:
            self.replicas.cleanup_orphans(deployments)
        return self._reconcile(deployments, full=True)

    def reconcile_changed(self, *, requested: bool = False) -> PassResult:
        """A full pass when something may have changed (asked for, an event seen, the
        resync due); otherwise a pass over only the deployments with work to do: settled
        ones with a probe due are probed from what the last pass read of them, and read
        and reconciled only when a probe found a change."""
        if self.schedule.full_due(requested):
            return self.reconcile_all()
        started = time.perf_counter()
        due = self.schedule.due()
        quiet = [self.settled[pk] for pk in due
                 if pk in self.settled and pk not in self.schedule.active]
        changed, known = self.replicas.pacer.probe_settled(quiet)
        for deployment, replicas in quiet:
            if deployment.pk not in changed:
                self.note(deployment, replicas, calm=True, creates_replicas=False)
        visit = {pk for pk in due if pk not in self.settled} | self.schedule.active | changed
        if not visit:
            return PassResult(full=False, seconds=time.perf_counter() - started)
        deployments = list(Deployment.objects.filter(pk__in=visit)
                           .select_related("model", "backend").prefetch_related("replica_set"))
        for gone in visit - {d.pk for d in deployments}:
            self.schedule.forget(gone)
            self.settled.pop(gone, None)
        return self._reconcile(deployments, full=False, known=known)

    def note(self, deployment: Deployment, replicas: list[Replica], *, calm: bool,
             creates_replicas: bool) -> None:
        """Where a deployment stands after its visit; a settled one's records are kept to
        probe it from."""
        self.schedule.note(deployment.pk, calm, min(
            (self.replicas.pacer.next_at(r, creates_replicas) for r in replicas),
            default=float("inf")))
        if calm:
            self.settled[deployment.pk] = (deployment, replicas)
        else:
            self.settled.pop(deployment.pk, None)

    def _reconcile(self, deployments: list[Deployment], *, full: bool,
                   known: dict[int, Observation] | None = None) -> PassResult:
        started = time.perf_counter()
        result = PassResult(full=full)
        self.pod_sets.refresh(deployments)
        self.replicas.observe_all(deployments, known)
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
        self.note(deployment, replicas, calm=calm, creates_replicas=chosen.creates_replicas)
        return changed
