from __future__ import annotations

from django.contrib import admin

from models_registry.models import Model


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin[Model]):
    list_display = ("name", "architecture", "parameter_count", "context_length", "status",
                    "source")
    list_filter = ("status", "source", "architecture")
    search_fields = ("name", "display_name", "source_uri")
    readonly_fields = ("created_at", "updated_at", "progress")
