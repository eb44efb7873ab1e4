"""Capacity estimates: how much KV cache, and how many sequences, fit on an accelerator.

KV-cache bytes per token = 2 (keys and values) x layers x KV heads x head size x bytes per
element. The memory vLLM may use is total x utilisation; from that the weights and an
overhead for activations and graphs are taken, and the rest holds KV cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 1024**3

# Accelerator memory presets, in GiB: a 24 GiB card, an 80 GiB A100/H100, a 141 GiB H200.
MEMORY_PRESETS_GIB: tuple[int, ...] = (24, 80, 141)
DEFAULT_UTILIZATION = 0.9
DEFAULT_OVERHEAD_GIB = 1.0
DEFAULT_SEQUENCE_LENGTH = 2048

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "auto": 2, "": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "int8": 1,
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "float32", "fp8",
                                    "fp8_e4m3", "fp8_e5m2")


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def kv_bytes_per_token(layers: int, kv_heads: int, head_size: int, element_bytes: int) -> int:
    return 2 * layers * kv_heads * head_size * element_bytes


@dataclass(frozen=True)
class CapacityEstimate:
    memory_gib: float
    utilization: float
    overhead_gib: float
    sequence_length: int
    kv_cache_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_cache_tokens: int
    max_concurrent_sequences: int
    fits: bool

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def estimate_capacity(
    *,
    weight_bytes: int,
    kv_bytes_per_token: int,
    memory_gib: float,
    utilization: float = DEFAULT_UTILIZATION,
    overhead_gib: float = DEFAULT_OVERHEAD_GIB,
    sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
    kv_cache_dtype: str = "auto",
) -> CapacityEstimate:
    if memory_gib <= 0:
        raise ValueError("memory_gib must be positive")
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    if overhead_gib < 0:
        raise ValueError("overhead_gib must not be negative")
    if sequence_length < 1:
        raise ValueError("sequence_length must be at least 1")
    if kv_bytes_per_token < 1:
        raise ValueError("kv_bytes_per_token must be positive")
    usable = int(memory_gib * GIB * utilization) - weight_bytes - int(overhead_gib * GIB)
    kv_cache_bytes = max(usable, 0)
    tokens = kv_cache_bytes // kv_bytes_per_token
    return CapacityEstimate(
        memory_gib=memory_gib,
        utilization=utilization,
        overhead_gib=overhead_gib,
        sequence_length=sequence_length,
        kv_cache_dtype=kv_cache_dtype,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache_tokens=tokens,
        max_concurrent_sequences=tokens // sequence_length,
        fits=tokens >= sequence_length,
    )
