from __future__ import annotations

from rest_framework.routers import SimpleRouter

from controlplane.api.views import (
    BackendViewSet,
    DeploymentViewSet,
    EventViewSet,
    ReplicaViewSet,
)

router = SimpleRouter(trailing_slash=True)
router.register("backends", BackendViewSet, basename="backend")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("replicas", ReplicaViewSet, basename="replica")
router.register("events", EventViewSet, basename="event")
urlpatterns = router.urls
