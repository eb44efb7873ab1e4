from __future__ import annotations

from django.contrib import admin

from controlplane.models import AuditEvent, Backend, Deployment, Replica


@admin.register(Backend)
class BackendAdmin(admin.ModelAdmin[Backend]):
    list_display = ("name", "kind", "created_at")
    list_filter = ("kind",)


class ReplicaInline(admin.TabularInline[Replica, Deployment]):
    model = Replica
    extra = 0
    fields = ("name", "phase", "role", "endpoint", "pid", "restart_count", "ready_at")
    readonly_fields = fields
    can_delete = False


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin[Deployment]):
    list_display = ("name", "model", "backend", "state", "replicas", "generation",
                    "observed_generation")
    list_filter = ("state", "backend")
    search_fields = ("name",)
    inlines = [ReplicaInline]
    readonly_fields = ("generation", "observed_generation", "conditions", "replica_serial")


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    list_display = ("name", "deployment", "phase", "role", "endpoint", "pid", "restart_count")
    list_filter = ("phase", "role")
    search_fields = ("name",)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin[AuditEvent]):
    list_display = ("at", "actor", "action", "deployment", "replica_name")
    list_filter = ("action", "actor")
    search_fields = ("message", "replica_name")
