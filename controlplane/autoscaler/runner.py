"""The autoscaler's runner: every interval, beside the collector in the controllers'
process, a decision for every running deployment with an enabled policy, applied through
`Deployment.replicas` (the reconciler does the rest) and recorded as an event."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from controlplane.autoscaler.decisions import (
    Decision,
    Figures,
    Memory,
    decide,
    figures_from_summary,
)
from controlplane.autoscaler.policy import Policy, PolicyError
from controlplane.backends.base import backend_for
from controlplane.collector import current
from controlplane.metrics.store import ScalingDecision
from controlplane.models import Deployment
from controlplane.reconciler import promote_now
from controlplane.reconciler.schedule import fleet_revision
from controlplane.services import audit
from serving.demand import total as demand_total


class Autoscaler:
    """Decides for every running deployment with an enabled policy, from the collector in
    this process; applies changes to `Deployment.replicas` (the reconciler does the rest)
    and records each change, and each new reason for holding, as an event with its
    inputs."""

    ACTOR = "autoscaler"

    def __init__(self) -> None:
        self.memory: dict[int, Memory] = {}
        # Dashboard messages for the decisions of the last passes, sent by the caller
        # (`controllers.run_autoscaler`) from its event loop, then cleared.
        self.charted: list[dict[str, Any]] = []
        # The fleet revision (controlplane/reconciler/schedule.py) at which the last pass
        # found no running deployment with a policy; None when it found one.
        self.none_at: int | None = None

    def nothing_to_decide(self) -> bool:
        """Whether a pass now would find nothing to decide for, known without asking the
        database: the last one found no deployment with a policy and no pass of this
        process's reconciler has been full or changed anything since (a policy set, a
        deployment started: every change made through the API, the pages or the CLI
        writes an event the change watch sees; a SQL write, at the next resync). Only
        where a reconciler runs beside (the fleet revision above 0)."""
        revision = fleet_revision()
        return revision > 0 and self.none_at == revision

    def run_once(self, now: float | None = None, moment: datetime | None = None
                 ) -> list[tuple[str, Decision]]:
        """Decide for every deployment; each decision is also added to the collector's
        series of its deployment (charted and listed on the dashboard), see
        `chart_decision`."""
        revision = fleet_revision()  # before the query: a change during it is seen next
        now = time.time() if now is None else now
        moment = datetime.now(UTC) if moment is None else moment
        collector = current()
        fleet = collector.store.fleet if collector is not None else {}
        summaries = {d["name"]: d for d in fleet.get("deployments") or []}
        at = float(fleet.get("t") or 0.0)
        decisions = []
        deployments = list(Deployment.objects.filter(
            deleting=False, state=Deployment.State.RUNNING).exclude(autoscaling=None)
            .select_related("backend"))  # one query: read again below, it was two
        for deployment in deployments:
            policy = enabled_policy(deployment)
            if policy is None or scaled_by_platform(deployment):
                continue
            memory = self.memory.setdefault(deployment.pk, Memory())
            figures = figures_of(deployment, collector, summaries.get(deployment.name),
                                 at, now)
            decision = decide(policy, deployment.replicas, figures, memory, now, moment,
                              stale_seconds=3 * settings.SCRAPE_INTERVAL)
            decisions.append((deployment.name, decision))
            self.charted.extend(chart_decision(collector, deployment.name, decision, now))
            self.apply(deployment, decision, memory)
        live = {d.pk for d in deployments}
        for pk in set(self.memory) - live:
            del self.memory[pk]
        self.none_at = revision if not live else None
        return decisions

    def apply(self, deployment: Deployment, decision: Decision, memory: Memory) -> None:
        """Write a change (only if the count is still the one decided from) and its event,
        promoting a ready standby at once on a scale-up; a new reason for holding is an
        event too, once."""
        record = decision_record(decision)
        if decision.changes:
            changed = Deployment.objects.filter(
                pk=deployment.pk, replicas=deployment.replicas).update(
                replicas=decision.desired)
            if changed:
                audit(self.ACTOR, "autoscaled", deployment,
                      f"{deployment.replicas} -> {decision.desired} replicas: "
                      f"{decision.reason}", before={"replicas": deployment.replicas},
                      after=record)
            if changed and decision.desired > decision.current:
                promote_now(deployment.pk)  # a ready standby serves at once
            memory.last_reason = ""
        elif decision.reason.startswith("holding") and decision.reason != \
                memory.last_reason:
            audit(self.ACTOR, "autoscaler-holding", deployment, decision.reason,
                  after=record)
            memory.last_reason = decision.reason
        elif not decision.reason.startswith("holding"):
            memory.last_reason = ""


def enabled_policy(deployment: Deployment) -> Policy | None:
    """The deployment's policy, or None when it is off (or an old one no longer valid:
    stored policies are checked on the way in, so such a one is skipped)."""
    try:
        policy = Policy.from_dict(deployment.autoscaling,
                                  min_replicas=deployment.min_replicas,
                                  max_replicas=deployment.max_replicas)
    except PolicyError:
        return None
    return policy if policy.enabled else None


def scaled_by_platform(deployment: Deployment) -> bool:
    """Kubernetes sets the count itself (an HPA or KEDA): its policy only makes the
    gateway hold requests while the deployment is at zero (KEDA's wake trigger), and the
    control plane never writes the count beside the platform's autoscaler."""
    try:
        backend = backend_for(deployment.backend)
    except Exception:  # a backend that cannot be built is the reconciler's to report
        return False
    return bool(getattr(backend, "scales_itself", lambda: False)())


def figures_of(deployment: Deployment, collector: Any, summary: dict[str, Any] | None,
               at: float, now: float) -> Figures | None:
    """The deployment's figures: the collector's summary, and at zero the requests
    waiting for it at the gateway (None: nothing known)."""
    waiting = (demand_total(deployment.name, settings.REDIS_URL)
               if deployment.replicas == 0 else 0)
    if summary is not None:
        return figures_from_summary(summary, at, demand=waiting,
                                    gpu=gpu_of(collector, deployment.name))
    return Figures(at=now, demand=waiting) if waiting else None


def decision_record(decision: Decision) -> dict[str, Any]:
    """A decision as its event stores it: counts, reason and inputs."""
    return {"current": decision.current, "desired": decision.desired,
            "reason": decision.reason, **decision.inputs}


def chart_decision(collector: Any, deployment: str, decision: Decision, now: float
                   ) -> list[dict[str, Any]]:
    """Every decision, steady ones included, joins the deployment's latest sample in the
    metrics store (so a dashboard that connects later gets it with the history) and
    becomes one message for the dashboards open now. The event log keeps only changes and
    new reasons for holding."""
    if collector is None:
        return []
    message = collector.store.annotate(deployment, ScalingDecision(
        at=now, current=decision.current, desired=decision.desired, reason=decision.reason,
        signals=decision.inputs.get("signals", {})))
    return [message] if message is not None else []


def gpu_of(collector: Any, deployment: str) -> float | None:
    """Mean GPU utilisation of the deployment's active replicas in the last pass."""
    if collector is None:
        return None
    values = []
    for series in collector.store.replicas.values():
        if series.target.deployment == deployment and series.target.role != "standby" \
                and series.samples:
            value = series.samples[-1].get("gpu_util")
            if value is not None:
                values.append(float(value))
    return sum(values) / len(values) if values else None
