"""Capacity estimates for a registered model, as the API and the model page show them."""

from __future__ import annotations

from models_registry.capacity import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_UTILIZATION,
    MEMORY_PRESETS_GIB,
    CapacityEstimate,
    estimate_capacity,
)
from models_registry.models import Model


class CapacityUnknownError(ValueError):
    """The model's shape is not known (yet), so nothing can be estimated."""


def model_capacity(
    model: Model,
    *,
    memory_gib: float | None = None,
    utilization: float = DEFAULT_UTILIZATION,
    overhead_gib: float = DEFAULT_OVERHEAD_GIB,
    sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
    kv_cache_dtype: str = "auto",
) -> list[CapacityEstimate]:
    """One estimate per memory preset, or one for the given memory size."""
    kv_per_token = model.kv_bytes_per_token(kv_cache_dtype)
    weights = model.weight_bytes()
    if kv_per_token is None or weights is None:
        raise CapacityUnknownError(
            f"the shape of model {model.name} is not known yet (status {model.status})"
        )
    sizes: tuple[float, ...] = (memory_gib,) if memory_gib else tuple(map(float,
                                                                          MEMORY_PRESETS_GIB))
    return [
        estimate_capacity(
            weight_bytes=weights, kv_bytes_per_token=kv_per_token, memory_gib=size,
            utilization=utilization, overhead_gib=overhead_gib,
            sequence_length=sequence_length, kv_cache_dtype=kv_cache_dtype,
        )
        for size in sizes
    ]
