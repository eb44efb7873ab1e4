from __future__ import annotations

from typing import Any

from rest_framework import serializers

from access.strict_json import StrictJSON
from models_registry.capacity import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_UTILIZATION,
    KV_CACHE_DTYPES,
)
from models_registry.models import Model
from models_registry.services import NAME_PATTERN


class ModelSerializer(serializers.ModelSerializer):
    kv_bytes_per_token = serializers.SerializerMethodField()
    weight_bytes = serializers.SerializerMethodField()

    class Meta:
        model = Model
        fields = [
            "name", "display_name", "source", "source_uri", "revision", "license", "path",
            "architecture", "parameter_count", "context_length", "dtype", "num_layers",
            "num_attention_heads", "num_kv_heads", "head_size", "size_bytes",
            "has_chat_template", "task", "kv_bytes_per_token", "weight_bytes", "status",
            "progress",
            "error", "created_at", "updated_at",
        ]
        read_only_fields = fields

    def get_kv_bytes_per_token(self, model: Model) -> int | None:
        return model.kv_bytes_per_token()

    def get_weight_bytes(self, model: Model) -> int | None:
        return model.weight_bytes()


class ModelCreateSerializer(StrictJSON, serializers.Serializer):
    """Register a model: `path` for a local folder or GGUF file (under MODEL_IMPORT_ROOTS),
    `hf_id` for the Hub, `package` for the model folder an installed package carries."""

    name = serializers.RegexField(NAME_PATTERN, max_length=63)
    # A serializer field named "source" shadows Field.source only for the type checker.
    source = serializers.ChoiceField(choices=Model.Source.choices)  # type: ignore[assignment]
    path = serializers.CharField(max_length=1000, required=False, allow_blank=True)
    hf_id = serializers.CharField(max_length=200, required=False, allow_blank=True)
    package = serializers.CharField(max_length=100, required=False, allow_blank=True)
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    revision = serializers.CharField(max_length=200, required=False, allow_blank=True)
    license = serializers.CharField(max_length=200, required=False, allow_blank=True)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["source"] == Model.Source.HUGGINGFACE:
            if not attrs.get("hf_id"):
                raise serializers.ValidationError(
                    {"hf_id": "required when source is huggingface"}
                )
        elif attrs["source"] == Model.Source.PACKAGE:
            if not attrs.get("package"):
                raise serializers.ValidationError(
                    {"package": "required when source is package"})
        elif not attrs.get("path"):
            raise serializers.ValidationError(
                {"path": f"required when source is {attrs['source']}"}
            )
        return attrs


class CapacityQuerySerializer(serializers.Serializer):
    memory_gib = serializers.FloatField(min_value=0.01, max_value=100_000, required=False)
    utilization = serializers.FloatField(min_value=0.01, max_value=1.0,
                                         default=DEFAULT_UTILIZATION)
    overhead_gib = serializers.FloatField(min_value=0, max_value=10_000,
                                          default=DEFAULT_OVERHEAD_GIB)
    sequence_length = serializers.IntegerField(min_value=1, max_value=10_000_000,
                                               default=DEFAULT_SEQUENCE_LENGTH)
    kv_cache_dtype = serializers.ChoiceField(choices=KV_CACHE_DTYPES, default="auto")


class CapacityEstimateSerializer(serializers.Serializer):
    memory_gib = serializers.FloatField()
    utilization = serializers.FloatField()
    overhead_gib = serializers.FloatField()
    sequence_length = serializers.IntegerField()
    kv_cache_dtype = serializers.CharField()
    weight_bytes = serializers.IntegerField()
    kv_bytes_per_token = serializers.IntegerField()
    kv_cache_bytes = serializers.IntegerField()
    kv_cache_tokens = serializers.IntegerField()
    max_concurrent_sequences = serializers.IntegerField()
    fits = serializers.BooleanField()
