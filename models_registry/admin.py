"""Models are shown here, not edited: they are registered and imported through the REST API
and the Models page, which keep a model's folder under MODEL_IMPORT_ROOTS and write the
audit log. A source URL or error that carries a credential is shown masked."""

from __future__ import annotations

from django.contrib import admin

from access.redaction import redact_text, redact_url
from models_registry.models import Model
from serving.admin import ReadOnly


@admin.register(Model)
class ModelAdmin(ReadOnly, admin.ModelAdmin[Model]):
    list_display = ("name", "architecture", "parameter_count", "context_length", "status",
                    "source")
    list_filter = ("status", "source", "architecture")
    search_fields = ("name", "display_name")
    fields = ("name", "display_name", "source", "shown_source_uri", "revision", "license",
              "path", "architecture", "parameter_count", "context_length", "dtype",
              "num_layers", "num_attention_heads", "num_kv_heads", "head_size", "size_bytes",
              "has_chat_template", "status", "progress", "shown_error", "created_at",
              "updated_at")
    readonly_fields = fields

    @admin.display(description="source")
    def shown_source_uri(self, model: Model) -> str:
        return redact_url(model.source_uri or "")

    @admin.display(description="error")
    def shown_error(self, model: Model) -> str:
        return redact_text(model.error or "")
