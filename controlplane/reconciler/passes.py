"""The reconcile pass: once over every deployment, each handed to the reconciler of its
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

logger = logging.getLogger(__name__)


@dataclass
class PassResult:
    """What one pass did: deployments seen, how many changed, its duration, its errors."""

    deployments: int = 0
    changed: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class Reconciler:
    """Level-triggered: each pass reads desired and observed state and converges. What it
    keeps between passes (in its two reconcilers) only paces probes, backs off and tells
    events once; everything else is read again on each pass."""

    def __init__(self, progress: Callable[[str], None] | None = None) -> None:
        self.replicas = ReplicaReconciler()
        self.pod_sets = PodSetReconciler()
        # Told after each deployment: a pass over a large fleet is progress, step by step,
        # to the liveness check and the Lease (controlplane/liveness.py).
        self.progress = progress

    @property
    def last_probe(self) -> dict[int, float]:
        """When each ready replica's health was last probed (monotonic seconds)."""
        return self.replicas.last_probe

    def reconcile_all(self) -> PassResult:
        """One pass over every deployment; one deployment's failure does not stop it."""
        started = time.perf_counter()
        result = PassResult()
        deployments = list(Deployment.objects.select_related("model", "backend")
                           .prefetch_related("replica_set"))
        if not self.replicas.orphans_checked:
            self.replicas.cleanup_orphans(deployments)
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
            if self.progress is not None:
                self.progress(f"reconciled {deployment.name}")
        result.seconds = time.perf_counter() - started
        return result

    def reconcile_deployment(self, deployment: Deployment) -> bool:
        """Converge one deployment through the reconciler of its backend's kind."""
        chosen = backend_for(deployment.backend)
        replicas = list(deployment.replica_set.all())
        if chosen.owns_pods:
            return self.pod_sets.reconcile(deployment, cast(PodSetBackend, chosen), replicas)
        return self.replicas.reconcile(deployment, cast(ReplicaBackend, chosen), replicas)
