"""The reconciler: level-triggered. Each pass reads desired state (deployments) and
observed state (replica records plus what the backend sees), converges, and writes status.
A pass with nothing to do writes nothing; a pass after any failure converges.

Two reconcilers share the role assignment (`roles`) and the status writer (`status`):
`replicas.ReplicaReconciler` for backends that run each replica (local, external) and
`pod_sets.PodSetReconciler` for backends whose platform runs the pods (Kubernetes).
`passes.Reconciler` runs the pass over every deployment and picks the right one.
"""

from __future__ import annotations

from controlplane.reconciler.passes import PassResult, Reconciler
from controlplane.reconciler.roles import promote_now
from controlplane.reconciler.status import restart_backoff

__all__ = ["PassResult", "Reconciler", "promote_now", "restart_backoff"]
