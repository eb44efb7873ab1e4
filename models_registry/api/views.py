from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
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

from access.listing import SEARCH_MAX_CHARACTERS, FilterError
from access.roles import actor_of
from models_registry import services
from models_registry.api.serializers import (
    CapacityEstimateSerializer,
    CapacityQuerySerializer,
    ModelCreateSerializer,
    ModelSerializer,
)
from models_registry.capacity_report import model_capacity
from models_registry.filters import MODEL_FILTERS
from models_registry.models import Model


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("search", {"type": "string", "maxLength": SEARCH_MAX_CHARACTERS,
                                "pattern": "^[^\\u0000]*$"},
                     description="part of the name, display name or "
                     f"architecture (case-insensitive; at most {SEARCH_MAX_CHARACTERS} "
                     "characters)"),
    *(OpenApiParameter(param, str, enum=list(options))
      for param, options in MODEL_FILTERS.choices.items())]))
class ModelViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """The model registry: list, inspect, register (and import), delete."""

    queryset = Model.objects.all()
    serializer_class = ModelSerializer
    lookup_field = "name"
    lookup_value_regex = "[-a-zA-Z0-9_]+"

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The list filtered by `search`, `status`, `task`, `source` (a bad one: 400)."""
        queryset = super().filter_queryset(queryset)
        if self.action != "list":
            return queryset
        try:
            given = MODEL_FILTERS.read(self.request.query_params.getlist)
        except FilterError as exc:
            raise serializers.ValidationError({exc.param: [exc.message]}) from None
        return MODEL_FILTERS.apply(queryset, given)

    @extend_schema(
        request=ModelCreateSerializer,
        responses={201: ModelSerializer, 202: ModelSerializer,
                   400: OpenApiResponse(description="the field at fault, with the reason")},
        description="Register a model. A local folder is ready at once (201); a GGUF file "
        "is converted in the background (202: poll `status` and `progress`); a Hugging "
        "Face id is recorded for backends that download at start (201).",
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        query = ModelCreateSerializer(data=request.data)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        spec = services.ModelSpec(
            name=data["name"], source=data["source"],
            uri=data.get("hf_id") or data.get("package") or data.get("path") or "",
            display_name=data.get("display_name", ""), revision=data.get("revision", ""),
            license=data.get("license", ""),
        )
        model = services.register_model(spec, actor=actor_of(request))
        code = status.HTTP_202_ACCEPTED if model.status == Model.Status.IMPORTING else \
            status.HTTP_201_CREATED
        return Response(ModelSerializer(model).data, status=code)

    def perform_destroy(self, instance: Model) -> None:
        services.delete_model(instance, actor=actor_of(self.request))

    @extend_schema(
        parameters=[CapacityQuerySerializer],
        responses={200: CapacityEstimateSerializer(many=True)},
        description="How many tokens of KV cache, and how many concurrent sequences of "
        "`sequence_length` tokens, fit in an accelerator. Without `memory_gib`: one "
        "estimate for each preset (24, 80 and 141 GiB).",
    )
    @action(detail=True, methods=["get"], pagination_class=None)
    def capacity(self, request: Request, name: str | None = None) -> Response:
        query = CapacityQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        estimates = model_capacity(self.get_object(), **query.validated_data)
        return Response([estimate.as_dict() for estimate in estimates])
