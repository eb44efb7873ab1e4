"""The Django admin site (admins only). Everything here is shown, not edited: backends,
deployments and the audit log are made and changed through the REST API (and the
deployment pages), which check them against the install's allow-lists and engine-args
validation, keep masked secrets and write the audit log; an edit here would skip all of
that, and an audit event is never changed or deleted here (only its retention removes it:
controlplane/audit_log.py). Nothing shown here carries a secret (access/redaction.py)."""

from __future__ import annotations

import json
from functools import cached_property

from django.conf import settings
from django.contrib import admin
from django.core.paginator import Paginator

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
class DeploymentAdmin(ReadOnly, admin.ModelAdmin[Deployment]):
    list_display = ("name", "model", "backend", "state", "replicas", "generation",
                    "observed_generation")
    list_filter = ("state", "backend")
    search_fields = ("name",)
    inlines = [ReplicaInline]
    fields = ("name", "model", "backend", "state", "shown_engine_args", "replicas",
              "min_replicas", "max_replicas", "standby", "shown_autoscaling",
              "shown_admission", "routing_policy", "aliases", "generation",
              "observed_generation", "shown_conditions", "replica_serial", "deleting",
              "created_at", "updated_at")
    readonly_fields = fields

    @admin.display(description="engine args (secrets masked)")
    def shown_engine_args(self, deployment: Deployment) -> str:
        return json.dumps(redact(deployment.engine_args), indent=2, sort_keys=True)

    @admin.display(description="autoscaling")
    def shown_autoscaling(self, deployment: Deployment) -> str:
        return json.dumps(redact(deployment.autoscaling), indent=2, sort_keys=True)

    @admin.display(description="admission")
    def shown_admission(self, deployment: Deployment) -> str:
        return json.dumps(redact(deployment.admission), indent=2, sort_keys=True)

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


class BoundedCountPaginator(Paginator):
    """Counts up to EVENTS_COUNT_LIMIT rows, not the whole audit log: the pages past it are
    reached by narrowing the list (filters, search), as in the events API."""

    @cached_property
    def count(self) -> int:
        cap = int(settings.EVENTS_COUNT_LIMIT)
        return min(self.object_list[:cap + 1].count(), cap)  # type: ignore[attr-defined]


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnly, admin.ModelAdmin[AuditEvent]):
    list_display = ("last_seen", "count", "at", "actor", "action", "deployment",
                    "replica_name", "shown_message")
    list_filter = ("action", "actor")
    search_fields = ("action", "replica_name")
    # Neither the unfiltered total nor a page count of the whole log is counted in full.
    show_full_result_count = False
    paginator = BoundedCountPaginator
    fields = ("at", "last_seen", "count", "actor", "action", "deployment", "replica_name",
              "shown_message", "shown_before", "shown_after")
    readonly_fields = fields

    @admin.display(description="message")
    def shown_message(self, event: AuditEvent) -> str:
        return redact_text(event.message or "")

    @admin.display(description="before (secrets masked)")
    def shown_before(self, event: AuditEvent) -> str:
        return redact_text(json.dumps(redact(event.before), indent=2, sort_keys=True))

    @admin.display(description="after (secrets masked)")
    def shown_after(self, event: AuditEvent) -> str:
        return redact_text(json.dumps(redact(event.after), indent=2, sort_keys=True))
