"""Publishes serving's route table from the database: which ready, active replicas of
which running deployment take traffic, under which model names."""

from __future__ import annotations

from django.conf import settings

from controlplane.models import Deployment, Replica
from serving.routes import Pool, RouteReplica, build_table, routes


def current_pools() -> list[Pool]:
    pools = []
    deployments = (Deployment.objects.filter(deleting=False).select_related("model")
                   .prefetch_related("replica_set"))
    for deployment in deployments:
        ready = tuple(
            RouteReplica(name=r.name, url=r.endpoint)
            for r in deployment.replica_set.all()
            if r.phase == Replica.Phase.READY and r.role == Replica.Role.ACTIVE and r.endpoint
            and deployment.state == Deployment.State.RUNNING
        )
        served = deployment.served_model_name()
        names = tuple(dict.fromkeys([served, deployment.name, *deployment.aliases]))
        pools.append(Pool(deployment=deployment.name, served_model_name=served,
                          policy=deployment.routing_policy,
                          max_model_len=deployment.engine_args.get("max_model_len")
                          or deployment.model.context_length,
                          replicas=ready, names=names,
                          wakes=deployment.state == Deployment.State.RUNNING and bool(
                              (deployment.autoscaling or {}).get("enabled"))))
    return pools


def publish_routes() -> bool:
    """Hand the gateway the current table (and Redis, when configured); True if changed."""
    return routes.publish(build_table(current_pools()), settings.REDIS_URL)
