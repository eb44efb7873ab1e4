from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from access.roles import actor_of
from controlplane import filters, services
from controlplane.api.filtering import FilteredList, filter_parameters
from controlplane.api.pagination import BoundedCountPage, count_param, single_param
from controlplane.api.serializers import (
    AuditEventSerializer,
    BackendSerializer,
    BackendUpdateSerializer,
    DeploymentListSerializer,
    DeploymentSerializer,
    DeploymentUpdateSerializer,
    ReplicaSerializer,
    ScaleSerializer,
)
from controlplane.backends.base import backend_for
from controlplane.models import AuditEvent, Backend, Deployment, Replica

MAX_LOG_LINES = 5000
# Names in paths: what a name may hold, so a NUL never reaches a query (PostgreSQL refuses
# it with an error, not an empty answer); anything else is the JSON 404 of urls.py.
DNS_NAME = "[-a-z0-9]+"
ANY_NAME = "[^/.\x00]+"


class LogTailSerializer(serializers.Serializer):
    replica = serializers.CharField()
    lines = serializers.ListField(child=serializers.CharField(allow_blank=True))


@extend_schema_view(list=extend_schema(parameters=filter_parameters(filters.BACKENDS)))
class BackendViewSet(FilteredList, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     mixins.CreateModelMixin, mixins.UpdateModelMixin, viewsets.GenericViewSet):
    """Where replicas run: `local` processes, `external` endpoints, `kubernetes`. Secrets in
    a config are shown as `***`; sending `***` back keeps the stored secret."""

    queryset = Backend.objects.all()
    serializer_class = BackendSerializer
    filters = filters.BACKENDS
    lookup_field = "name"
    lookup_value_regex = DNS_NAME
    read_role, write_role = "operator", "admin"
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        if self.action == "partial_update":
            return BackendUpdateSerializer
        return BackendSerializer

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        assert isinstance(serializer.instance, Backend)
        config = serializer.validated_data.get("config", serializer.instance.config)
        serializer.instance = services.update_backend(serializer.instance, config,
                                                      actor=actor_of(self.request))

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        data = serializer.validated_data
        serializer.instance = services.create_backend(
            data["name"], data["kind"], data.get("config") or {}, actor=actor_of(self.request))


@extend_schema_view(list=extend_schema(
    parameters=filter_parameters(filters.DEPLOYMENTS),
    description="Deployments, without their replicas (`replica_list` is on each one's own "
                "endpoint); filter with `search`, `model`, `backend`, `state`."))
class DeploymentViewSet(FilteredList, viewsets.ModelViewSet):
    """Desired deployments: a model, engine args, a replica count, a backend."""

    serializer_class = DeploymentSerializer
    filters = filters.DEPLOYMENTS
    lookup_field = "name"
    lookup_value_regex = DNS_NAME
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet[Deployment]:
        deployments = Deployment.objects.select_related("model", "backend")
        if self.action == "list":
            return filters.with_ready_count(deployments)
        return deployments.prefetch_related("replica_set")

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        if self.action == "partial_update":
            return DeploymentUpdateSerializer
        if self.action == "list":
            return DeploymentListSerializer
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
    @action(detail=True, methods=["get"], pagination_class=BoundedCountPage)
    def events(self, request: Request, name: str | None = None) -> Response:
        """The deployment's audit events, last seen first, a page at a time (its count
        bounded: controlplane/api/pagination.py BoundedCountPage)."""
        events = AuditEvent.objects.filter(deployment=self.get_object())
        page = self.paginate_queryset(events)
        return self.get_paginated_response(AuditEventSerializer(page, many=True).data)


@extend_schema_view(list=extend_schema(parameters=filter_parameters(filters.REPLICAS)))
class ReplicaViewSet(FilteredList, viewsets.ReadOnlyModelViewSet):
    """Observed replicas; filter with `?deployment=<name>`, `?phase=`, `?search=`."""

    serializer_class = ReplicaSerializer
    lookup_field = "name"
    lookup_value_regex = ANY_NAME
    action_roles = {"logs": "operator"}
    queryset = Replica.objects.select_related("deployment", "deployment__backend")
    filters = filters.REPLICAS

    @extend_schema(parameters=[
        OpenApiParameter("lines", {"type": "integer", "minimum": 1, "maximum": MAX_LOG_LINES},
                         description=f"last N lines (1..{MAX_LOG_LINES}, default 200)"),
        OpenApiParameter("follow", bool, description="keep streaming new lines"),
    ], responses={(200, "application/json"): LogTailSerializer,
                  (200, "text/plain"): OpenApiResponse(str, description="with follow")})
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, name: str | None = None) -> Any:
        replica = self.get_object()
        lines = count_param(request, "lines", 200, minimum=1, maximum=MAX_LOG_LINES)
        follow = single_param(request, "follow") or "false"
        if follow not in ("true", "false"):
            raise serializers.ValidationError({"follow": ["must be true or false"]})
        tail = backend_for(replica.deployment.backend).logs(replica, lines)
        if follow == "false":
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


@csrf_exempt  # it changes nothing, and a POST to an unknown path must get JSON too
def not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """Anything under /api/v1/ that names no operation: a 404 in the API's shape (Django's
    own 404 page is HTML, which no API client expects)."""
    return JsonResponse({"detail": "Not found."}, status=404)


@extend_schema_view(list=extend_schema(parameters=filter_parameters(filters.EVENTS)))
class EventViewSet(FilteredList, viewsets.ReadOnlyModelViewSet):
    """The audit log (admins): what changed, who changed it, before and after, and what
    the controllers did; a repeated event is one entry with its `count` and `last_seen`,
    last seen first. Filter with `?deployment=<name>`, `?action=<action>` (e.g.
    key-created, user-role-changed, model-deleted), `?actor=<name>`, `?replica=<name>`."""

    serializer_class = AuditEventSerializer
    pagination_class = BoundedCountPage
    read_role = "admin"
    lookup_value_regex = "[0-9]+"
    queryset = AuditEvent.objects.select_related("deployment")
    filters = filters.EVENTS
