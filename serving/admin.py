from __future__ import annotations

from django.contrib import admin

from serving.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ("name", "prefix", "scope", "created_at", "revoked_at")
    list_filter = ("scope",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "key_hash", "created_at")

    def has_add_permission(self, request: object) -> bool:
        # Keys are made with `manage.py create_api_key`, which shows the key once.
        return False
