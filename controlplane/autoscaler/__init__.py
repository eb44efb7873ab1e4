"""The autoscaler: every interval, from the metrics store, the desired number of active
replicas of each deployment that has an autoscaling policy.

A policy (`Deployment.autoscaling`, checked by `Policy.from_dict`: `policy`) names one or
more signals with targets. Each signal proposes a count the way Kubernetes' HPA does,
ceil(current * value / target), or for per-replica signals ceil(total / target); the
largest proposal wins. The result is kept within min..max (a schedule may give other
bounds by time of day), then stabilized: a scale-up takes the smallest proposal of the
scale-up window, a scale-down the largest of the scale-down window (so one quiet scrape
does not drop capacity), moves at most `max_step` replicas, and waits `cooldown_seconds`
after a change. A signal that is missing or stale never lowers the count: the autoscaler
holds and says why. With min 0 a deployment with no traffic for `idle_seconds` goes to
zero; demand seen at the gateway for it brings one replica back at once.

`decisions.decide` is a pure function of the policy, the figures and the remembered
proposals, so whole scenarios are tested without processes; `runner.Autoscaler.run_once`
applies decisions through the same service as a person's change and records each as an
event carrying its inputs. This package exports only the pure parts: the runner needs
the controllers' world (collector, reconciler, services), which itself imports the
policy.
"""

from __future__ import annotations

from controlplane.autoscaler.decisions import (
    Decision,
    Figures,
    Memory,
    decide,
    figures_from_summary,
)
from controlplane.autoscaler.policy import Policy, PolicyError, Window

__all__ = ["Decision", "Figures", "Memory", "Policy", "PolicyError", "Window", "decide",
           "figures_from_summary"]
