"""What the lists of the control plane may be filtered and searched by, in the REST API
and on the pages alike (access/listing.py reads and applies them)."""

from __future__ import annotations

from django.db.models import Count, IntegerField, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from access.listing import Filters, choices_of
from controlplane.models import Backend, Deployment, Replica
from serving.models import ApiKey

DEPLOYMENTS = Filters(
    search=("name", "model__name", "backend__name"),
    exact={"model": "model__name", "backend": "backend__name"},
    choices={"state": choices_of("state", Deployment.State.values)},
    describe={"search": "part of the name, the model's or the backend's name",
              "state": "running or stopped"})

TEAMS = Filters(search=("name",))

BACKENDS = Filters(search=("name",), choices={"kind": choices_of("kind", Backend.Kind.values)})

REPLICAS = Filters(
    search=("name",),
    exact={"deployment": "deployment__name"},
    choices={"phase": choices_of("phase", Replica.Phase.values)},
    describe={"deployment": "only this deployment's replicas"})

EVENTS = Filters(
    exact={"deployment": "deployment__name", "action": "action", "actor": "actor",
           "replica": "replica_name"},
    describe={"deployment": "only this deployment's events",
              "action": "e.g. key-created, model-deleted",
              "actor": "who did it: a username, `system`, ...",
              "replica": "only this replica's events"})


def unexpired() -> Q:
    return Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())


# Callables: they compare with the time the list is read.
KEY_STATES = {"active": lambda: Q(revoked_at__isnull=True) & unexpired(),
              "revoked": lambda: Q(revoked_at__isnull=False),
              "expired": lambda: Q(revoked_at__isnull=True, expires_at__lte=timezone.now())}

KEYS = Filters(
    search=("name", "prefix"),
    exact={"team": "team__name"},
    choices={"scope": choices_of("scope", ApiKey.Scope.values), "state": KEY_STATES},
    describe={"search": "part of the name or the prefix",
              "state": "active, revoked or expired", "team": "only this team's keys"})



def with_ready_count(deployments: QuerySet[Deployment]) -> QuerySet[Deployment]:
    """Each deployment's ready replicas as `ready_count`, counted per row by a subquery: a
    list's page count (a COUNT of the filtered rows) leaves it out, where a join and GROUP
    BY would be counted over the whole fleet."""
    ready = (Replica.objects.filter(deployment=OuterRef("pk"), phase=Replica.Phase.READY)
             .order_by().values("deployment").annotate(n=Count("id")).values("n"))
    counted = Subquery(ready, output_field=IntegerField())
    return deployments.annotate(ready_count=Coalesce(counted, 0)).order_by("name")
