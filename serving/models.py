"""API keys: who may call the control plane's API (admin) and the gateway (inference)."""

from __future__ import annotations

from django.db import models


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
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…, {self.scope})"

    def is_active(self) -> bool:
        return self.revoked_at is None

    def allows_admin(self) -> bool:
        return self.is_active() and self.scope == self.Scope.ADMIN
