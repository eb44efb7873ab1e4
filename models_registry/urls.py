from __future__ import annotations

from django.urls import path

from models_registry import views

urlpatterns = [
    path("", views.model_list, name="registry"),
    path("<slug:name>/", views.model_detail, name="model-page"),
    path("<slug:name>/delete/", views.model_delete, name="model-page-delete"),
]
