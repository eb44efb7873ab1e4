"""Keys, teams and users through the REST API (admins only). A key's secret is in the
answer to its creation, once; lists show its prefix."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from access.roles import USER_ROLE_CHOICES, actor_of, create_user, role_of, set_role
from access.strict_json import StrictJSON
from controlplane import filters
from controlplane.api.filtering import FilteredList, filter_parameters
from controlplane.services import audit
from serving import services
from serving.models import ApiKey, Team
from serving.priority import classes
from serving.services import MAX_LIMIT


class ApiKeySerializer(serializers.ModelSerializer):
    team: serializers.SlugRelatedField[Team] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True)
    user: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True)
    models = serializers.ListField(source="allowed_models", read_only=True)
    rpm = serializers.IntegerField(source="rpm_limit", read_only=True, allow_null=True)
    tpm = serializers.IntegerField(source="tpm_limit", read_only=True, allow_null=True)
    active = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "scope", "team", "user", "models", "priority",
                  "rpm", "tpm", "expires_at", "created_at", "revoked_at", "active",
                  "requests_total", "prompt_tokens_total", "completion_tokens_total",
                  "last_used_at"]
        read_only_fields = fields

    def get_active(self, record: ApiKey) -> bool:
        return record.is_active()


# A name must have something besides spaces (it is stored stripped).
NOT_BLANK = r"^[^\u0000]*[^\s\u0000][^\u0000]*$"


class ApiKeyCreateSerializer(StrictJSON, serializers.Serializer):
    name = serializers.RegexField(NOT_BLANK, max_length=100)
    scope = serializers.ChoiceField(choices=ApiKey.Scope.values, default="inference")
    team = serializers.CharField(required=False, allow_null=True, default=None,
                                 max_length=100)
    user = serializers.CharField(required=False, allow_null=True, default=None,
                                 max_length=150)
    models = serializers.ListField(child=serializers.RegexField(NOT_BLANK, max_length=200),
                                   required=False, default=list, max_length=100)
    priority = serializers.ChoiceField(choices=[], required=False, allow_null=True,
                                       default=None, help_text="a priority class name")
    rpm = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=1,
                                   max_value=MAX_LIMIT)
    tpm = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=1,
                                   max_value=MAX_LIMIT)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read now, not at import: the classes come from settings.
        priority = self.fields["priority"]
        assert isinstance(priority, serializers.ChoiceField)
        priority.choices = list(classes())


@extend_schema_view(list=extend_schema(parameters=filter_parameters(filters.KEYS)))
class ApiKeyViewSet(FilteredList, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                    viewsets.GenericViewSet):
    """API keys: create (the secret is shown once, in `key`), list (filter with `search`,
    `team`, `scope`, `state`), revoke."""

    serializer_class = ApiKeySerializer
    filters = filters.KEYS
    queryset = ApiKey.objects.select_related("team", "user")
    lookup_value_regex = "[0-9]+"
    read_role = write_role = "admin"

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeySerializer})
    def create(self, request: Request) -> Response:
        query = ApiKeyCreateSerializer(data=request.data)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        record, key = services.create_api_key(
            data["name"], data["scope"], team=data["team"], user=data["user"],
            models=data["models"], priority=data["priority"], rpm=data["rpm"],
            tpm=data["tpm"], expires_at=data["expires_at"], actor=actor_of(request))
        return Response({**ApiKeySerializer(record).data, "key": key},
                        status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        record = services.revoke_api_key(self.get_object(), actor=actor_of(request))
        return Response(ApiKeySerializer(record).data)


class TeamSerializer(StrictJSON, serializers.ModelSerializer):
    # Uniqueness is the service's to check: a taken name is a 409, not a 400.
    name = serializers.RegexField(NOT_BLANK, max_length=100)
    rpm = serializers.IntegerField(source="rpm_limit", required=False, allow_null=True,
                                   min_value=1, max_value=MAX_LIMIT)
    tpm = serializers.IntegerField(source="tpm_limit", required=False, allow_null=True,
                                   min_value=1, max_value=MAX_LIMIT)
    keys = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = ["name", "rpm", "tpm", "keys", "created_at"]
        read_only_fields = ["keys", "created_at"]

    def get_keys(self, team: Team) -> int:
        return team.keys.filter(revoked_at__isnull=True).count()


@extend_schema_view(list=extend_schema(parameters=filter_parameters(filters.TEAMS)))
class TeamViewSet(FilteredList, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                  mixins.CreateModelMixin, mixins.UpdateModelMixin, viewsets.GenericViewSet):
    """Teams: a request and token budget per minute shared by their keys."""

    serializer_class = TeamSerializer
    queryset = Team.objects.all()
    filters = filters.TEAMS
    lookup_field = "name"
    lookup_value_regex = "[^/\x00]+"
    read_role = write_role = "admin"
    http_method_names = ["get", "post", "patch", "head", "options"]

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        data: Any = serializer.validated_data
        serializer.instance = services.create_team(
            data["name"], rpm=data.get("rpm_limit"), tpm=data.get("tpm_limit"),
            actor=actor_of(self.request))

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        data: Any = serializer.validated_data
        limits = {field: data[f"{field}_limit"] for field in ("rpm", "tpm")
                  if f"{field}_limit" in data}
        assert isinstance(serializer.instance, Team)
        serializer.instance = services.update_team(serializer.instance,
                                                   actor=actor_of(self.request), **limits)


class UserSerializer(StrictJSON, serializers.Serializer):
    username = serializers.RegexField(r"^[\w.@+-]{1,150}$")
    role = serializers.ChoiceField(choices=USER_ROLE_CHOICES, default="viewer")
    password = serializers.CharField(write_only=True, required=False, min_length=8,
                                     max_length=128)
    is_active = serializers.BooleanField(default=True)
    is_superuser = serializers.BooleanField(read_only=True)
    last_login = serializers.DateTimeField(read_only=True, allow_null=True)
    date_joined = serializers.DateTimeField(read_only=True)

    def to_representation(self, user: Any) -> dict[str, Any]:
        return {"username": user.get_username(), "role": role_of(user) or "none",
                "is_active": user.is_active, "is_superuser": user.is_superuser,
                "last_login": self.fields["last_login"].to_representation(user.last_login)
                if user.last_login else None,
                "date_joined": self.fields["date_joined"].to_representation(user.date_joined)}


class NewUserSerializer(UserSerializer):
    password = serializers.CharField(  # type: ignore[assignment]
        read_only=True, allow_null=True,
        help_text="made here when no password was given: shown this once; null when "
                  "the request gave one")


class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Users and their roles: viewer (dashboards), operator (deploy, scale), admin (keys,
    users). A new user's password is given, or made and shown once in `password`."""

    serializer_class = UserSerializer
    lookup_field = "username"
    lookup_value_regex = r"[\w.@+-]+"
    read_role = write_role = "admin"

    def get_queryset(self) -> QuerySet[Any]:
        return get_user_model().objects.prefetch_related("groups").order_by("username")

    @extend_schema(request=UserSerializer, responses={201: NewUserSerializer})
    def create(self, request: Request) -> Response:
        query = UserSerializer(data=request.data)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        # A taken username raises UserExists: a 409 (controlplane/api/errors.py).
        user, password = create_user(
            data["username"], None if data["role"] == "none" else data["role"],
            actor=actor_of(request), password=data.get("password") or "",
            is_active=data["is_active"])
        body = dict(UserSerializer(user).data)
        body["password"] = None if data.get("password") else password  # shown this once
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=UserSerializer, responses=UserSerializer)
    def partial_update(self, request: Request, username: str | None = None) -> Response:
        user = self.get_object()
        if not isinstance(request.data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": ["the body must be a JSON object"]})
        query = UserSerializer(data={"username": user.get_username(), **request.data},
                               partial=True)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        actor = actor_of(request)
        if user.is_superuser and not getattr(request.user, "is_superuser", False):
            # Nobody but a superuser may change one (their role, state or password).
            raise serializers.ValidationError(
                {"username": ["a superuser is changed only by a superuser, in the admin "
                              "site"]})
        if user.is_superuser and "role" in request.data:
            raise serializers.ValidationError(
                {"role": ["a superuser is always an admin"]})
        with transaction.atomic():
            if "role" in request.data:
                set_role(user, None if data["role"] == "none" else data["role"], actor=actor)
            if "is_active" in request.data and data["is_active"] != user.is_active:
                user.is_active = data["is_active"]
                user.save(update_fields=["is_active"])
                audit(actor, "user-changed", None, f"user {user.get_username()} "
                      f"{'enabled' if user.is_active else 'disabled'}",
                      after={"is_active": user.is_active})
            if data.get("password"):
                user.set_password(data["password"])
                user.save(update_fields=["password"])
                audit(actor, "user-changed", None,
                      f"user {user.get_username()}: password set")
        return Response(UserSerializer(user).data)
