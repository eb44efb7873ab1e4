from __future__ import annotations

from typing import Any

import pytest
from rest_framework.exceptions import ValidationError

from controlplane.engine_args import (
    engine_args_misfit,
    engine_command_line,
    validate_engine_args,
)
from models_registry.models import Model
from tests.factories import DEMO_SHAPE


def demo_model() -> Model:
    return Model(name="smollm2", **DEMO_SHAPE)


def errors_of(args: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ValidationError) as error:
        validate_engine_args(args)
    assert isinstance(error.value.detail, dict)
    return dict(error.value.detail)


def test_known_args_are_accepted_and_typed() -> None:
    args = validate_engine_args({"max_model_len": 2048, "dtype": "bfloat16",
                                 "gpu_memory_utilization": 0.85, "scheduling_policy": "priority",
                                 "enable_prefix_caching": True,
                                 "extra_args": ["--enforce-eager", "--seed", "7"]})
    assert args["max_model_len"] == 2048
    assert args["extra_args"] == ["--enforce-eager", "--seed", "7"]


def test_an_unknown_arg_is_refused_by_name() -> None:
    assert "max_batch" in errors_of({"max_batch": 8})


@pytest.mark.parametrize(("extra", "message"), [
    (["--trust-remote-code"], "not an allowed extra argument"),
    (["--seed"], "needs a value"),
    (["--enforce-eager=1"], "takes no value"),
    (["--seed", "1;rm -rf /"], "unsafe characters"),
])
def test_extra_args_are_checked_against_the_allow_list(extra: list[str], message: str) -> None:
    assert message in str(errors_of({"extra_args": extra})["extra_args"])


def test_too_many_extra_args_are_refused() -> None:
    assert "extra_args" in errors_of({"extra_args": ["--enforce-eager"] * 33})


@pytest.mark.parametrize(("field", "value"), [("gpu_memory_utilization", 1.5),
                                               ("scheduling_policy", "lifo"),
                                               ("tensor_parallel_size", 0)])
def test_out_of_range_values_name_their_field(field: str, value: object) -> None:
    assert field in errors_of({field: value})


def test_a_max_model_len_above_the_context_length_does_not_fit() -> None:
    misfit = engine_args_misfit({"max_model_len": 16384}, demo_model())
    assert "above the context length" in misfit["max_model_len"]


def test_a_tensor_parallel_size_must_divide_the_attention_heads() -> None:
    assert engine_args_misfit({"tensor_parallel_size": 3}, demo_model()) == {}
    misfit = engine_args_misfit({"tensor_parallel_size": 2}, demo_model())
    assert "does not divide the 9 attention heads" in misfit["tensor_parallel_size"]


def test_the_command_line_carries_every_set_option() -> None:
    line = engine_command_line({"max_model_len": 2048, "enable_prefix_caching": False,
                                "scheduling_policy": "priority",
                                "extra_args": ["--enforce-eager"]},
                               model_path="/m", served_name="demo", port=9000)
    assert line[:8] == ["--model", "/m", "--served-model-name", "demo", "--host",
                        "127.0.0.1", "--port", "9000"]
    assert "--max-model-len" in line and "2048" in line
    assert "--no-enable-prefix-caching" in line
    assert line[-1] == "--enforce-eager"
