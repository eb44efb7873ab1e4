"""API keys: who may call the control plane's API (admin) and the gateway (inference)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Team(models.Model):
    """A group of keys sharing one request and token budget."""

    name = models.CharField(max_length=100, unique=True)
    # Per minute, shared by all the team's keys; empty: no team-wide limit.
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    class Scope(models.TextChoices):
        ADMIN = "admin", "Admin (REST API and inference)"
        INFERENCE = "inference", "Inference (OpenAI-compatible gateway)"

    name = models.CharField(max_length=100)
    scope = models.CharField(max_length=20, choices=Scope.choices)
    # The first characters of the key, shown so a person can tell keys apart.
    prefix = models.CharField(max_length=16)
    # SHA-256 of the whole key. Keys are 256 random bits, so a fast hash is safe and
    # keeps the lookup cheap; the key itself is never stored.
    key_hash = models.CharField(max_length=64, unique=True)
    # Models (served names or deployment names) the key may call; empty allows all.
    allowed_models = models.JSONField(default=list, blank=True)
    # Whose key it is: a team (sharing the team's budget) or a user, or neither.
    team = models.ForeignKey(Team, on_delete=models.PROTECT, null=True, blank=True,
                             related_name="keys")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True,
                             blank=True, related_name="api_keys")
    # A priority class name (settings.PRIORITY_CLASSES): the highest this key may ask for.
    priority = models.CharField(max_length=30, default="standard")
    # Per minute, for this key alone; empty: no limit of its own.
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Totals, added to when usage records are written.
    requests_total = models.PositiveBigIntegerField(default=0)
    prompt_tokens_total = models.PositiveBigIntegerField(default=0)
    completion_tokens_total = models.PositiveBigIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…, {self.scope})"

    def is_active(self) -> bool:
        from django.utils import timezone

        return self.revoked_at is None and (
            self.expires_at is None or self.expires_at > timezone.now())

    def allows_admin(self) -> bool:
        return self.is_active() and self.scope == self.Scope.ADMIN


#: The longest X-Request-Id the gateway passes on and records; a longer one is replaced
#: by a generated id (the usage column holds exactly this many characters).
REQUEST_ID_MAX_LENGTH = 200


class UsageRecord(models.Model):
    """One answered request, written in batches off the hot path."""

    at = models.DateTimeField(db_index=True)
    request_id = models.CharField(max_length=REQUEST_ID_MAX_LENGTH)
    # Made by the gateway for each record (a client may send the same X-Request-Id
    # twice): a batch written again after a commit whose reply was lost adds each record
    # once. Empty on records written before it existed.
    record_id = models.CharField(max_length=32, unique=True, null=True, blank=True,
                                 editable=False)
    # No database constraint: a record written after its key was deleted must not make
    # the whole batch fail.
    key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True,
                            db_constraint=False)
    # Set for requests made in the browser playground, as the logged-in user.
    username = models.CharField(max_length=150, blank=True)
    model = models.CharField(max_length=200)
    deployment = models.CharField(max_length=100)
    replica = models.CharField(max_length=100, blank=True)
    status = models.PositiveSmallIntegerField()
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    queue_ms = models.FloatField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    itl_ms = models.FloatField(null=True, blank=True)  # mean between streamed chunks
    e2e_ms = models.FloatField()

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["key", "at"]), models.Index(fields=["deployment", "at"])]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status}"
