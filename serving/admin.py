from __future__ import annotations

from django.contrib import admin

from serving.models import ApiKey, Team


class ReadOnly:
    """Keys and teams are only shown here: they are made, changed and revoked on the Keys
    page, through the REST API or `manage.py create_api_key`, which show a key once and
    write the audit log."""

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnly, admin.ModelAdmin[ApiKey]):
    list_display = ("name", "prefix", "scope", "team", "user", "priority", "rpm_limit",
                    "tpm_limit", "expires_at", "requests_total", "last_used_at",
                    "revoked_at")
    list_filter = ("scope", "priority", "team")
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "key_hash", "created_at", "requests_total",
                       "prompt_tokens_total", "completion_tokens_total", "last_used_at")


@admin.register(Team)
class TeamAdmin(ReadOnly, admin.ModelAdmin[Team]):
    list_display = ("name", "rpm_limit", "tpm_limit", "created_at")
    search_fields = ("name",)
