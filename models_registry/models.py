"""The registry: which models exist, where their weights are, and what they need."""

from __future__ import annotations

from django.db import models

from models_registry.capacity import dtype_bytes, kv_bytes_per_token


class Model(models.Model):
    class Source(models.TextChoices):
        LOCAL = "local", "Local Hugging Face folder"
        GGUF = "gguf", "GGUF file"
        HUGGINGFACE = "huggingface", "Hugging Face id"
        PACKAGE = "package", "Model folder in an installed Python package"

    class Task(models.TextChoices):
        GENERATE = "generate", "Text generation (chat, completions)"
        EMBED = "embed", "Embeddings"

    class Status(models.TextChoices):
        REGISTERED = "registered", "Registered"
        IMPORTING = "importing", "Importing"
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"

    name = models.SlugField(max_length=100, unique=True)
    display_name = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=20, choices=Source.choices)
    # Where the weights come from: a folder, a GGUF file, or a Hugging Face id.
    source_uri = models.CharField(max_length=1000)
    revision = models.CharField(max_length=200, blank=True)
    license = models.CharField(max_length=200, blank=True)
    # The folder vLLM is pointed at (empty for Hugging Face ids, which backends download).
    path = models.CharField(max_length=1000, blank=True)

    architecture = models.CharField(max_length=200, blank=True)
    parameter_count = models.BigIntegerField(null=True, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    dtype = models.CharField(max_length=20, blank=True)
    num_layers = models.PositiveIntegerField(null=True, blank=True)
    num_attention_heads = models.PositiveIntegerField(null=True, blank=True)
    num_kv_heads = models.PositiveIntegerField(null=True, blank=True)
    head_size = models.PositiveIntegerField(null=True, blank=True)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    has_chat_template = models.BooleanField(default=False)
    # What the model does; it chooses the engine's runner and the endpoints it answers.
    task = models.CharField(max_length=20, choices=Task.choices, default=Task.GENERATE)

    status = models.CharField(max_length=20, choices=Status.choices, default=Status.REGISTERED)
    progress = models.FloatField(default=0.0)  # 0..100, while importing
    error = models.TextField(blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def is_ready(self) -> bool:
        return self.status == self.Status.READY

    def has_shape(self) -> bool:
        """Whether enough is known to estimate memory."""
        return bool(self.num_layers and self.num_kv_heads and self.head_size)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int | None:
        if not self.has_shape():
            return None
        assert self.num_layers and self.num_kv_heads and self.head_size
        element = dtype_bytes(self.dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size, element)

    def weight_bytes(self) -> int | None:
        """Bytes the weights take in accelerator memory at the model's dtype."""
        if self.parameter_count:
            return self.parameter_count * dtype_bytes(self.dtype)
        return self.size_bytes
