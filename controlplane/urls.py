from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane import views
from controlplane.login import ThrottledAdminAuthenticationForm

# The admin's login page counts failures like the login page does.
admin.site.login_form = ThrottledAdminAuthenticationForm

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="registry", permanent=False), name="home"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    # Probes (deploy/kubernetes/gateway.yaml): liveness without the database, readiness
    # with it; /healthz keeps its meaning (the database answers) under its old name.
    path("livez", views.livez, name="livez"),
    path("readyz", views.readyz, name="readyz"),
    path("healthz", views.readyz, name="healthz"),
    path("models/", include("models_registry.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include("models_registry.api.urls")),
    path("api/v1/", include("controlplane.api.urls")),
    path("deployments/", include("controlplane.pages")),
    path("", include("controlplane.live")),
    path("", include("controlplane.access")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]
