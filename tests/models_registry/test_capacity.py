from __future__ import annotations

import pytest

from models_registry.capacity import GIB, dtype_bytes, estimate_capacity, kv_bytes_per_token
from models_registry.capacity_report import CapacityUnknownError, model_capacity
from tests.factories import make_model


def test_kv_bytes_per_token_of_the_demo_model_shape_is_23040() -> None:
    # 2 (K and V) x 30 layers x 3 KV heads x 64 head size x 2 bytes (bf16)
    assert kv_bytes_per_token(30, 3, 64, dtype_bytes("bfloat16")) == 23_040


def test_fp8_kv_cache_halves_the_bytes_per_token() -> None:
    assert kv_bytes_per_token(30, 3, 64, dtype_bytes("fp8")) == 11_520


def test_estimate_takes_weights_and_overhead_out_of_the_usable_memory() -> None:
    estimate = estimate_capacity(weight_bytes=2 * GIB, kv_bytes_per_token=1024,
                                 memory_gib=10, utilization=0.5, overhead_gib=1,
                                 sequence_length=1024)
    assert estimate.kv_cache_bytes == 2 * GIB  # 5 GiB usable - 2 weights - 1 overhead
    assert estimate.kv_cache_tokens == 2 * GIB // 1024
    assert estimate.max_concurrent_sequences == 2 * GIB // 1024 // 1024
    assert estimate.fits


def test_a_model_larger_than_the_memory_fits_no_sequence() -> None:
    estimate = estimate_capacity(weight_bytes=30 * GIB, kv_bytes_per_token=1024,
                                 memory_gib=24)
    assert estimate.kv_cache_tokens == 0
    assert estimate.max_concurrent_sequences == 0
    assert not estimate.fits


@pytest.mark.parametrize("bad", [
    {"memory_gib": 0}, {"memory_gib": 24, "utilization": 1.5},
    {"memory_gib": 24, "sequence_length": 0}, {"memory_gib": 24, "overhead_gib": -1},
])
def test_estimate_refuses_impossible_inputs(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        estimate_capacity(weight_bytes=1, kv_bytes_per_token=1, **bad)  # type: ignore[arg-type]


@pytest.mark.django_db
def test_model_capacity_gives_one_estimate_per_preset() -> None:
    model = make_model()
    estimates = model_capacity(model)
    assert [e.memory_gib for e in estimates] == [24, 80, 141]
    assert estimates[0].kv_bytes_per_token == 23_040
    assert estimates[0].weight_bytes == 134_515_008 * 2
    assert estimates[0].kv_cache_tokens < estimates[1].kv_cache_tokens < \
        estimates[2].kv_cache_tokens


@pytest.mark.django_db
def test_a_model_of_unknown_shape_has_no_estimate() -> None:
    model = make_model(num_layers=None, num_kv_heads=None, head_size=None)
    with pytest.raises(CapacityUnknownError):
        model_capacity(model)
