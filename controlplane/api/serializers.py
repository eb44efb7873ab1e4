from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from access.redaction import redact
from access.strict_json import StrictJSON
from controlplane.engine_args import SERVED_NAME, EngineArgsSerializer
from controlplane.models import AuditEvent, Backend, Deployment, Replica
from models_registry.models import Model
from models_registry.services import NAME_PATTERN

NAME_FIELD = serializers.RegexField(
    NAME_PATTERN, max_length=63,
    error_messages={"invalid": "use 1 to 63 lower-case letters, digits and hyphens, "
                               "starting and ending with a letter or digit"})


# Counts and budgets are stored as 32-bit integers.
MAX_INT = 2**31 - 1


class BackendSerializer(StrictJSON, serializers.ModelSerializer):
    name = NAME_FIELD
    config = serializers.DictField(required=False, default=dict,
                                   help_text="the kind's settings (docs/deployments.md); "
                                             "secrets in it are shown as ***")

    class Meta:
        model = Backend
        fields = ["name", "kind", "config", "created_at"]
        read_only_fields = ["created_at"]

    def to_representation(self, instance: Backend) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["config"] = redact(data.get("config") or {})
        return data


class BackendUpdateSerializer(BackendSerializer):
    class Meta(BackendSerializer.Meta):
        read_only_fields = ["name", "kind", "created_at"]


class ReplicaSerializer(serializers.ModelSerializer):
    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    time_to_ready_seconds = serializers.SerializerMethodField()

    class Meta:
        model = Replica
        fields = ["name", "deployment", "endpoint", "phase", "role", "generation", "pid",
                  "pod_name", "port", "devices", "started_at", "ready_at",
                  "time_to_ready_seconds", "last_health_at", "last_error", "restart_count",
                  "next_restart_at"]
        read_only_fields = fields

    def get_time_to_ready_seconds(self, replica: Replica) -> float | None:
        took = replica.time_to_ready()
        return round(took.total_seconds(), 2) if took else None

    def to_representation(self, instance: Replica) -> dict[str, Any]:
        data = super().to_representation(instance)
        # An external endpoint's URL may carry credentials.
        data["endpoint"] = redact(data["endpoint"])
        data["last_error"] = redact(data["last_error"])
        return data


@extend_schema_field({"type": "string", "pattern": NAME_PATTERN.pattern, "maxLength": 63})
class NameReference(serializers.SlugRelatedField):
    """A model or backend given by its name."""


@extend_schema_field(EngineArgsSerializer)
class EngineArgsField(serializers.DictField):
    pass


@extend_schema_field({"type": "object", "additionalProperties": {}, "nullable": True})
class SettingsField(serializers.DictField):
    pass


class DeploymentSerializer(StrictJSON, serializers.ModelSerializer):
    name = NAME_FIELD
    model = NameReference(slug_field="name", queryset=Model.objects.all())
    backend = NameReference(slug_field="name", queryset=Backend.objects.all(), required=False)
    engine_args = EngineArgsField(required=False, default=dict,
                                  help_text="see EngineArgs in docs/api.md")
    replicas = serializers.IntegerField(min_value=0, max_value=1000, default=1)
    min_replicas = serializers.IntegerField(min_value=0, max_value=1000, default=0)
    max_replicas = serializers.IntegerField(min_value=0, max_value=1000, default=4)
    standby = serializers.IntegerField(min_value=0, max_value=100, default=0)
    routing_policy = serializers.ChoiceField(choices=["least-load", "round-robin", "session",
                                                      "prefix"], default="least-load")
    aliases = serializers.ListField(child=serializers.RegexField(
        SERVED_NAME), max_length=16, default=list)
    autoscaling = SettingsField(
        required=False, allow_null=True, default=None,
        help_text="an autoscaling policy (docs/autoscaling.md); null: scaled by hand")
    admission = SettingsField(
        required=False, allow_null=True, default=None,
        help_text="replica_concurrency, long_prompt_tokens, long_replicas "
                  "(docs/admission.md); null: the defaults")
    ready_replicas = serializers.SerializerMethodField()
    replica_list = ReplicaSerializer(source="replica_set", many=True, read_only=True)

    class Meta:
        model = Deployment
        fields = ["name", "model", "backend", "engine_args", "replicas", "min_replicas",
                  "max_replicas", "standby", "routing_policy", "aliases", "autoscaling",
                  "admission", "state",
                  "generation", "observed_generation", "conditions", "ready_replicas",
                  "deleting", "replica_list", "created_at", "updated_at"]
        read_only_fields = ["state", "generation", "observed_generation", "conditions",
                            "deleting", "created_at", "updated_at"]

    def to_representation(self, instance: Deployment) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["conditions"] = redact(data["conditions"])  # they quote replicas' errors
        return data

    def get_ready_replicas(self, deployment: Deployment) -> int:
        return sum(1 for r in deployment.replica_set.all() if r.phase == Replica.Phase.READY)

    def validate_engine_args(self, value: Any) -> Any:
        serializer = EngineArgsSerializer(data=value)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)


class DeploymentListSerializer(DeploymentSerializer):
    """A row of the list: the deployment without its replicas (`replica_list` is on the
    deployment's own endpoint and on /api/v1/replicas/?deployment=<name>), so a page stays
    small however many replicas each has. `ready_replicas` is counted by the query."""

    ready_replicas = serializers.IntegerField(  # type: ignore[assignment]
        source="ready_count", read_only=True)

    class Meta(DeploymentSerializer.Meta):
        fields = [f for f in DeploymentSerializer.Meta.fields if f != "replica_list"]


class DeploymentUpdateSerializer(DeploymentSerializer):
    class Meta(DeploymentSerializer.Meta):
        read_only_fields = [*DeploymentSerializer.Meta.read_only_fields, "name", "backend"]


class ScaleSerializer(StrictJSON, serializers.Serializer):
    replicas = serializers.IntegerField(min_value=0, max_value=1000)


class AuditEventSerializer(serializers.ModelSerializer):
    # Null for changes that concern no deployment (keys, users, models).
    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = AuditEvent
        fields = ["at", "last_seen", "count", "actor", "action", "deployment", "replica_name",
                  "message", "before", "after"]
        read_only_fields = fields

    def to_representation(self, instance: AuditEvent) -> dict[str, Any]:
        # Entries are redacted when written; this covers those written before that was so.
        data = super().to_representation(instance)
        return {**data, **{name: redact(data[name]) for name in ("message", "before", "after")}}
