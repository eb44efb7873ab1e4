"""Role assignment, for both kinds of backend: which ready replicas take traffic and which
are warm standby, promotion at once on a scale-up, and who goes first on a scale-down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

from controlplane.backends.base import BackendError, PodSetBackend, backend_for
from controlplane.models import Deployment, Replica
from controlplane.reconciler.status import event, save
from controlplane.routing import publish_routes

logger = logging.getLogger(__name__)


def assign_roles(deployment: Deployment, replicas: list[Replica], *,
                 load: Callable[[Replica], int | None],
                 relabel: Callable[[Replica, str], None] | None = None,
                 leaving: frozenset[str] = frozenset(), everyone: bool = False) -> bool:
    """Ready replicas of the current generation take traffic up to the desired active
    count; the rest are warm standby (outside the route table). A standby is promoted
    at once when the count rises (no restart: on Kubernetes a label, `relabel`); on a
    scale-down the least loaded active ones (among equals the newest, whose caches are
    coldest) move to the standby pool. Replicas in `leaving` (chosen to go) do not
    count."""
    staying = [r for r in replicas if r.phase == Replica.Phase.READY
               and r.generation == deployment.generation and r.name not in leaving]
    active = [r for r in staying if r.role == Replica.Role.ACTIVE]
    standby = [r for r in staying if r.role == Replica.Role.STANDBY]
    wanted = len(staying) if everyone else deployment.desired_replicas()
    moves: list[tuple[Replica, str]] = []
    if len(active) < wanted:
        moves = [(r, Replica.Role.ACTIVE) for r in standby[:wanted - len(active)]]
    elif len(active) > wanted:
        loads = {r.pk: load(r) or 0 for r in active}
        extra = sorted(active, key=lambda r: (loads[r.pk], -(
            r.ready_at.timestamp() if r.ready_at else 0.0)))[:len(active) - wanted]
        moves = [(r, Replica.Role.STANDBY) for r in extra]
    changed = False
    for replica, role in moves:
        if relabel is not None:
            try:
                relabel(replica, role)
            except BackendError as exc:
                logger.warning("relabelling %s failed: %s", replica.name, exc)
                continue
        save(replica, role=role)
        event(deployment, "replica-promoted" if role == Replica.Role.ACTIVE else
              "replica-standby", f"{replica.name} " + (
                  "promoted: takes traffic" if role == Replica.Role.ACTIVE else
                  "moved to the warm standby pool: takes no new traffic"),
              replica=replica)
        changed = True
    return changed


def promote_now(deployment_pk: int) -> bool:
    """Promote ready standby replicas up to the desired active count right away, outside
    a reconcile pass (which may be busy probing loaded replicas), and hand the gateway the
    new route table: the autoscaler calls this after a scale-up. Idempotent with the pass's
    own role assignment, which reads deployment and replicas together."""
    deployment = Deployment.objects.select_related("backend").filter(
        pk=deployment_pk).first()
    if deployment is None or deployment.deleting:
        return False
    replicas = list(deployment.replica_set.all())
    chosen = backend_for(deployment.backend)
    relabel = None
    if chosen.owns_pods:
        pod_set = cast(PodSetBackend, chosen)
        replicas = [r for r in replicas if r.pod_name]

        def relabel(replica: Replica, role: str) -> None:
            pod_set.set_role(deployment, replica, role)

    staying = [r for r in replicas if r.phase == Replica.Phase.READY]
    active = sum(1 for r in staying if r.role == Replica.Role.ACTIVE)
    if active >= deployment.desired_replicas():
        return False  # only promotions here; moves to the pool wait for a pass
    changed = assign_roles(deployment, replicas, load=chosen.in_flight, relabel=relabel)
    if changed:
        publish_routes()
    return changed


def victim_order(replica: Replica) -> tuple[int, int, float]:
    """Who goes first: replicas not serving, then warm standby ones, then the newest."""
    serving = replica.phase == Replica.Phase.READY
    created = replica.created_at.timestamp() if replica.created_at else 0.0
    return (1 if serving else 0, 1 if replica.role == Replica.Role.ACTIVE else 0, -created)


def removal_order(replica: Replica, load: Callable[[Replica], int | None]
                  ) -> tuple[int, int, int]:
    """Which member of a pod set is chosen to go first: those not ready (the ReplicaSet
    removes them before any ready pod, whatever their deletion cost, so choosing them
    keeps its choice and ours the same), then warm standby ones, then the least loaded
    active ones."""
    standby = replica.role == Replica.Role.STANDBY
    ready = replica.phase == Replica.Phase.READY
    in_flight = load(replica) if ready and not standby else 0
    return (1 if ready else 0, 0 if standby else 1, in_flight if in_flight is not None else 0)
