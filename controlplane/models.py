"""Desired and observed state of the fleet: backends, deployments, replicas, events."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models
from django.utils import timezone

from models_registry.models import Model
from serving.sealing import new_engine_key, seal, unseal


def sealed_engine_key() -> str:
    """A new deployment's engine key, sealed for the database (serving/sealing.py)."""
    return seal(new_engine_key())


class Backend(models.Model):
    class Kind(models.TextChoices):
        LOCAL = "local", "Local processes"
        KUBERNETES = "kubernetes", "Kubernetes"
        EXTERNAL = "external", "External endpoint"

    name = models.SlugField(max_length=63, unique=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    # Kind-specific settings, validated by the backend (see controlplane/backends/).
    config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"


class Deployment(models.Model):
    class State(models.TextChoices):
        RUNNING = "running", "Running"
        STOPPED = "stopped", "Stopped"

    name = models.SlugField(max_length=63, unique=True)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    backend = models.ForeignKey(Backend, on_delete=models.PROTECT, related_name="deployments")
    engine_args = models.JSONField(default=dict, blank=True)
    replicas = models.PositiveIntegerField(default=1)
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=4)
    standby = models.PositiveIntegerField(default=0)
    # The autoscaling policy (controlplane/autoscaler/policy.py, Policy.as_dict()); null: the
    # replica count is set by hand only.
    autoscaling = models.JSONField(null=True, blank=True)
    # Gateway admission (docs/admission.md): requests per replica before queueing, and
    # long/short context pools; null: the defaults, one pool.
    admission = models.JSONField(null=True, blank=True)
    # How the gateway spreads requests among ready replicas (serving/router.py).
    routing_policy = models.CharField(max_length=20, default="least-load", choices=[
        ("least-load", "Least load"), ("round-robin", "Round robin"),
        ("session", "Session affinity"), ("prefix", "Prefix affinity")])
    # Further model names clients may use for this deployment.
    aliases = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.RUNNING)
    # generation counts changes of the spec that need new replicas (engine args, restart);
    # observed_generation is the one every replica runs once a rollout has finished.
    generation = models.PositiveIntegerField(default=1)
    observed_generation = models.PositiveIntegerField(default=0)
    conditions = models.JSONField(default=list, blank=True)
    # Set by a delete: the reconciler drains every replica, then removes the deployment.
    deleting = models.BooleanField(default=False)
    # Numbers replicas (<deployment>-1, -2, ...) so a name is never reused.
    replica_serial = models.PositiveIntegerField(default=0)
    # The bearer token its replicas demand (vLLM's --api-key), sealed with a key derived
    # from SECRET_KEY: a database dump does not hand out direct access to the replicas.
    # Not editable: no form, admin page or serializer shows it.
    engine_key_sealed = models.TextField(default=sealed_engine_key, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def desired_replicas(self) -> int:
        if self.deleting or self.state != self.State.RUNNING:
            return 0
        return self.replicas

    def desired_standby(self) -> int:
        """Warm standby replicas wanted: kept while scaled to zero (a request for it is
        then served at once), none while stopped or being deleted."""
        return self.standby if self.state == self.State.RUNNING and not self.deleting else 0

    def served_model_name(self) -> str:
        return str(self.engine_args.get("served_model_name") or self.name)

    def engine_key(self) -> str:
        """The key its replicas start with and every caller of theirs sends."""
        return unseal(self.engine_key_sealed)

    def upstream_key(self) -> str:
        """What the gateway and the controllers send as `Authorization: Bearer` to this
        deployment's replicas: an external endpoint's own api key, else the engine key."""
        if self.backend.kind == Backend.Kind.EXTERNAL:
            return str((self.backend.config or {}).get("api_key") or "")
        return self.engine_key()

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == kind), None)

    def is_ready(self) -> bool:
        available = self.condition("Available")
        return bool(available and available.get("status") == "True")


class Replica(models.Model):
    class Phase(models.TextChoices):
        PENDING = "pending", "Pending"
        STARTING = "starting", "Starting"
        LOADING = "loading", "Loading"
        WARMING = "warming", "Warming up"
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    class Role(models.TextChoices):
        ACTIVE = "active", "Active"
        STANDBY = "standby", "Standby"

    LIVE_PHASES = (Phase.PENDING, Phase.STARTING, Phase.LOADING, Phase.WARMING, Phase.READY)

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE,
                                   related_name="replica_set")
    name = models.CharField(max_length=100, unique=True)
    endpoint = models.CharField(max_length=300, blank=True)
    phase = models.CharField(max_length=20, choices=Phase.choices, default=Phase.PENDING)
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.ACTIVE)
    generation = models.PositiveIntegerField(default=1)
    pid = models.PositiveIntegerField(null=True, blank=True)
    # The process's start time, so a recycled pid is never mistaken for the replica.
    process_started = models.FloatField(null=True, blank=True)
    pod_name = models.CharField(max_length=253, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    devices = models.CharField(max_length=100, blank=True)
    log_path = models.CharField(max_length=500, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    restart_count = models.PositiveIntegerField(default=0)
    next_restart_at = models.DateTimeField(null=True, blank=True)
    drain_deadline = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment_id", "created_at", "id"]

    def __str__(self) -> str:
        return self.name

    def is_live(self) -> bool:
        return self.phase in self.LIVE_PHASES

    def time_to_ready(self) -> timedelta | None:
        if self.started_at and self.ready_at and self.ready_at >= self.started_at:
            return self.ready_at - self.started_at
        return None

    def restart_due(self) -> bool:
        return self.next_restart_at is None or self.next_restart_at <= timezone.now()


class AuditEvent(models.Model):
    """Who changed what, and what the controllers did and saw. An event that repeats within
    EVENT_COALESCE_SECONDS is one row (controlplane/audit_log.py): `at` is when it was first
    seen, `last_seen` the latest time, `count` how many times, `message` the latest wording."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    last_seen = models.DateTimeField(default=timezone.now)
    count = models.PositiveIntegerField(default=1)
    # What makes two events the same one (a digest, controlplane/audit_log.py:same_event_key).
    key = models.CharField(max_length=64, blank=True, default="", editable=False)
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=100)
    deployment = models.ForeignKey(Deployment, on_delete=models.SET_NULL, null=True,
                                   blank=True, related_name="events")
    replica_name = models.CharField(max_length=100, blank=True)
    message = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-last_seen", "-id"]
        indexes = [
            models.Index(fields=["key", "last_seen"], name="auditevent_key_seen"),
            models.Index(fields=["-last_seen", "-id"], name="auditevent_seen"),
            models.Index(fields=["deployment", "-last_seen", "-id"],
                         name="auditevent_deployment_seen"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action}"
