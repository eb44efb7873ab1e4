from __future__ import annotations

from django.urls import re_path
from rest_framework.routers import SimpleRouter

from controlplane.api.tenancy import ApiKeyViewSet, TeamViewSet, UserViewSet
from controlplane.api.views import (
    BackendViewSet,
    DeploymentViewSet,
    EventViewSet,
    ReplicaViewSet,
    not_found,
)

router = SimpleRouter(trailing_slash=True)
router.register("backends", BackendViewSet, basename="backend")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("events", EventViewSet, basename="event")
router.register("keys", ApiKeyViewSet, basename="key")
router.register("teams", TeamViewSet, basename="team")
router.register("users", UserViewSet, basename="user")
# Last: included after the registry's routes, so it only catches what no route matched.
urlpatterns = [*router.urls, re_path(r"^[\s\S]*$", not_found)]
