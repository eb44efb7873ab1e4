"""Publishes serving's route table from the database: which ready, active replicas of
which running deployment take traffic, under which model names."""

from __future__ import annotations

import logging

from django.conf import settings

from controlplane.models import Backend, Deployment, Replica
from serving.routes import DeploymentRoutes, RouteReplica, build_table, routes
from serving.sealing import SealError

logger = logging.getLogger(__name__)


def current_pools() -> list[DeploymentRoutes]:
    pools = []
    deployments = (Deployment.objects.filter(deleting=False).select_related("model", "backend")
                   .prefetch_related("replica_set"))
    for deployment in deployments:
        routable = [
            r for r in deployment.replica_set.all()
            if r.phase == Replica.Phase.READY and r.role == Replica.Role.ACTIVE and r.endpoint
            and deployment.state == Deployment.State.RUNNING
        ]
        try:
            key = deployment.upstream_key()
        except SealError:  # sealed under a SECRET_KEY no longer configured
            logger.error("the engine key of %s cannot be opened: rotate SECRET_KEY with "
                         "SECRET_KEY_FALLBACKS", deployment.name)
            key = ""
        ready = tuple(RouteReplica(name=r.name, url=r.endpoint, key=key) for r in routable)
        served = deployment.served_model_name()
        names = tuple(dict.fromkeys([served, deployment.name, *deployment.aliases]))
        admission = deployment.admission or {}
        long_count = admission.get("long_replicas", 0)
        # The long-context pool: the replicas ready longest (so a new replica joins the
        # short pool and the long one keeps its cache), leaving the short pool at least one.
        oldest = sorted(routable, key=lambda r: (r.ready_at or r.started_at or r.created_at,
                                                 r.name))
        long = tuple(r.name for r in oldest[:min(long_count, len(ready) - 1)])
        pools.append(DeploymentRoutes(deployment=deployment.name, served_model_name=served,
                          policy=deployment.routing_policy,
                          max_model_len=deployment.engine_args.get("max_model_len")
                          or deployment.model.context_length,
                          replicas=ready, names=names,
                          wakes=deployment.state == Deployment.State.RUNNING and bool(
                              (deployment.autoscaling or {}).get("enabled")),
                          replica_concurrency=admission.get("replica_concurrency")
                          or deployment.engine_args.get("max_num_seqs")
                          or settings.GATEWAY_REPLICA_CONCURRENCY,
                          priority_scheduling=deployment.engine_args.get(
                              "scheduling_policy") == "priority",
                          long_prompt_tokens=admission.get("long_prompt_tokens"),
                          long_replicas=long, task=deployment.model.task,
                          running_usage=deployment.backend.kind
                          != Backend.Kind.EXTERNAL))
    return pools


def publish_routes() -> bool:
    """Hand the gateway the current table (and Redis, when configured); True if changed."""
    return routes.publish(build_table(current_pools()), settings.REDIS_URL)
