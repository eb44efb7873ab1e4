from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from access.roles import actor_of
from controlplane import services
from controlplane.api.serializers import (
    AuditEventSerializer,
    BackendSerializer,
    DeploymentSerializer,
    DeploymentUpdateSerializer,
    ReplicaSerializer,
    ScaleSerializer,
)
from controlplane.backends.base import backend_for
from controlplane.models import AuditEvent, Backend, Deployment, Replica

MAX_LOG_LINES = 5000


class BackendViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     mixins.CreateModelMixin, viewsets.GenericViewSet):
    """Where replicas run: `local` processes, `external` endpoints."""

    queryset = Backend.objects.all()
    serializer_class = BackendSerializer
    lookup_field = "name"
    read_role, write_role = "operator", "admin"

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        data = serializer.validated_data
        serializer.instance = services.create_backend(
            data["name"], data["kind"], data.get("config") or {}, actor=actor_of(self.request))


class DeploymentViewSet(viewsets.ModelViewSet):
    """Desired deployments: a model, engine args, a replica count, a backend."""

    serializer_class = DeploymentSerializer
    lookup_field = "name"
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet[Deployment]:
        return Deployment.objects.select_related("model", "backend").prefetch_related(
            "replica_set")

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        if self.action == "partial_update":
            return DeploymentUpdateSerializer
        return DeploymentSerializer

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        data = serializer.validated_data
        backend = data.get("backend") or services.default_local_backend()
        serializer.instance = services.create_deployment(services.DeploymentSpec(
            name=data["name"], model=data["model"], backend=backend,
            engine_args=data.get("engine_args") or {}, replicas=data["replicas"],
            min_replicas=data["min_replicas"], max_replicas=data["max_replicas"],
            standby=data["standby"], routing_policy=data["routing_policy"],
            aliases=data["aliases"], autoscaling=data.get("autoscaling"),
            admission=data.get("admission")),
            actor=actor_of(self.request))

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        assert isinstance(serializer.instance, Deployment)
        serializer.instance = services.update_deployment(
            serializer.instance, dict(serializer.validated_data), actor=actor_of(self.request))

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        deployment = services.delete_deployment(self.get_object(), actor=actor_of(request))
        return Response(self.representation(deployment), status=status.HTTP_202_ACCEPTED)

    def representation(self, deployment: Deployment) -> dict[str, Any]:
        return dict(DeploymentSerializer(self.get_queryset().get(pk=deployment.pk)).data)

    @extend_schema(request=ScaleSerializer, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, name: str | None = None) -> Response:
        body = ScaleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        deployment = services.scale_deployment(self.get_object(), body.validated_data["replicas"],
                                               actor=actor_of(request))
        return Response(self.representation(deployment))

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, name: str | None = None) -> Response:
        deployment = services.set_deployment_state(self.get_object(), Deployment.State.STOPPED,
                                                   actor=actor_of(request))
        return Response(self.representation(deployment))

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, name: str | None = None) -> Response:
        deployment = services.set_deployment_state(self.get_object(), Deployment.State.RUNNING,
                                                   actor=actor_of(request))
        return Response(self.representation(deployment))

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, name: str | None = None) -> Response:
        deployment = services.restart_deployment(self.get_object(), actor=actor_of(request))
        return Response(self.representation(deployment))

    @extend_schema(responses=AuditEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request: Request, name: str | None = None) -> Response:
        events = AuditEvent.objects.filter(deployment=self.get_object())[:200]
        return Response(AuditEventSerializer(events, many=True).data)


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Observed replicas; filter with `?deployment=<name>`."""

    serializer_class = ReplicaSerializer
    lookup_field = "name"
    action_roles = {"logs": "operator"}

    def get_queryset(self) -> QuerySet[Replica]:
        queryset = Replica.objects.select_related("deployment", "deployment__backend")
        deployment = self.request.query_params.get("deployment")
        return queryset.filter(deployment__name=deployment) if deployment else queryset

    @extend_schema(parameters=[
        OpenApiParameter("lines", int, description=f"last N lines (1..{MAX_LOG_LINES})"),
        OpenApiParameter("follow", bool, description="keep streaming new lines"),
    ], responses={(200, "text/plain"): str})
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, name: str | None = None) -> Any:
        replica = self.get_object()
        try:
            lines = int(request.query_params.get("lines", "200"))
        except ValueError:
            raise serializers.ValidationError({"lines": ["must be a whole number"]}) from None
        if not 1 <= lines <= MAX_LOG_LINES:
            raise serializers.ValidationError({"lines": [f"must be 1..{MAX_LOG_LINES}"]})
        tail = backend_for(replica.deployment.backend).logs(replica, lines)
        if request.query_params.get("follow") not in ("1", "true", "yes"):
            return Response({"replica": replica.name, "lines": tail})
        return StreamingHttpResponse(follow_log(Path(replica.log_path), tail),
                                     content_type="text/plain; charset=utf-8")


async def follow_log(path: Path, tail: list[str]) -> AsyncIterator[bytes]:
    """The tail, then new lines as they are written, until the client goes away."""
    if tail:
        yield ("\n".join(tail) + "\n").encode()
    if not path.is_file():
        return
    with path.open("rb") as handle:
        handle.seek(0, 2)
        while True:
            chunk = handle.read(64 * 1024)
            if chunk:
                yield chunk
            else:
                await asyncio.sleep(0.5)


class EventViewSet(viewsets.ReadOnlyModelViewSet):
    """The audit log (admins): what changed, who changed it, before and after, and what
    the controllers did. Filter with `?deployment=<name>`, `?action=<action>` (e.g.
    key-created, user-role-changed, model-deleted), `?actor=<name>`."""

    serializer_class = AuditEventSerializer
    read_role = "admin"

    def get_queryset(self) -> QuerySet[AuditEvent]:
        queryset = AuditEvent.objects.select_related("deployment")
        for name, field in (("deployment", "deployment__name"), ("action", "action"),
                            ("actor", "actor")):
            value = self.request.query_params.get(name)
            if value:
                queryset = queryset.filter(**{field: value})
        return queryset
