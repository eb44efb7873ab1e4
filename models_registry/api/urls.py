from __future__ import annotations

from rest_framework.routers import SimpleRouter

from models_registry.api.views import ModelViewSet

router = SimpleRouter(trailing_slash=True)
router.register("models", ModelViewSet, basename="model")
urlpatterns = router.urls
