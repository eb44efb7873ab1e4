"""The Django admin site (admins only). Backends are shown, not edited, here: they are made
and changed on the Backends page or through the REST API, which check them against the
install's allow-lists, keep masked secrets and write the audit log. Nothing shown here
carries a secret (access/redaction.py)."""

from __future__ import annotations

import json

from django.contrib import admin

from access.redaction import redact, redact_text, redact_url
from controlplane.models import AuditEvent, Backend, Deployment, Replica
from serving.admin import ReadOnly


@admin.register(Backend)
class BackendAdmin(ReadOnly, admin.ModelAdmin[Backend]):
    list_display = ("name", "kind", "created_at")
    list_filter = ("kind",)
    fields = ("name", "kind", "shown_config", "created_at")
    readonly_fields = fields

    @admin.display(description="config (secrets masked)")
    def shown_config(self, backend: Backend) -> str:
        return json.dumps(redact(backend.config), indent=2, sort_keys=True)


class ReplicaInline(admin.TabularInline[Replica, Deployment]):
    model = Replica
    extra = 0
    fields = ("name", "phase", "role", "shown_endpoint", "pid", "restart_count", "ready_at")
    readonly_fields = fields
    can_delete = False

    @admin.display(description="endpoint")
    def shown_endpoint(self, replica: Replica) -> str:
        return redact_url(replica.endpoint or "")


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin[Deployment]):
    list_display = ("name", "model", "backend", "state", "replicas", "generation",
                    "observed_generation")
    list_filter = ("state", "backend")
    search_fields = ("name",)
    inlines = [ReplicaInline]
    exclude = ("conditions",)
    readonly_fields = ("generation", "observed_generation", "shown_conditions",
                       "replica_serial")

    @admin.display(description="conditions")
    def shown_conditions(self, deployment: Deployment) -> str:
        return redact_text(json.dumps(deployment.conditions, indent=2))


@admin.register(Replica)
class ReplicaAdmin(ReadOnly, admin.ModelAdmin[Replica]):
    list_display = ("name", "deployment", "phase", "role", "shown_endpoint", "pid",
                    "restart_count")
    list_filter = ("phase", "role")
    search_fields = ("name",)
    exclude = ("endpoint", "last_error")
    readonly_fields = ("shown_endpoint", "shown_error")

    @admin.display(description="endpoint")
    def shown_endpoint(self, replica: Replica) -> str:
        return redact_url(replica.endpoint or "")

    @admin.display(description="last error")
    def shown_error(self, replica: Replica) -> str:
        return redact_text(replica.last_error or "")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin[AuditEvent]):
    list_display = ("at", "actor", "action", "deployment", "replica_name")
    list_filter = ("action", "actor")
    search_fields = ("message", "replica_name")
