from __future__ import annotations

from typing import Any

import pytest
from rest_framework.exceptions import ValidationError

from controlplane.engine_args import (
    engine_args_misfit,
    engine_command_line,
    gpu_count,
    host_memory_gib_per_gpu,
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
                                               ("tensor_parallel_size", 0),
                                               ("pipeline_parallel_size", 0),
                                               ("pipeline_parallel_size", 65),
                                               ("pipeline_parallel_size", "two")])
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


def test_pipeline_parallel_size_reaches_the_command_line_and_counts_in_gpus() -> None:
    args = validate_engine_args({"tensor_parallel_size": 4, "pipeline_parallel_size": 2})
    line = engine_command_line(args, model_path="/m", served_name="big", port=8000)
    assert line[line.index("--pipeline-parallel-size") + 1] == "2"
    assert line[line.index("--tensor-parallel-size") + 1] == "4"
    assert gpu_count(args) == 8


def test_a_pipeline_parallel_size_in_extra_args_still_counts() -> None:
    args = validate_engine_args({"tensor_parallel_size": 2,
                                 "extra_args": ["--pipeline-parallel-size", "3"]})
    assert gpu_count(args) == 6
    assert gpu_count({"extra_args": ["--pipeline-parallel-size=2"]}) == 2
    assert gpu_count({}) == 1


def test_a_pipeline_parallel_size_given_twice_is_refused() -> None:
    errors = errors_of({"pipeline_parallel_size": 2,
                        "extra_args": ["--pipeline-parallel-size", "2"]})
    assert "given twice" in str(errors["pipeline_parallel_size"])


@pytest.mark.parametrize(("extra", "message"), [
    (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size needs a whole number"),
    (["--pipeline-parallel-size", "x"], "--pipeline-parallel-size needs a whole number"),
    (["--cpu-offload-gb", "-1"], "--cpu-offload-gb needs a number of GiB"),
])
def test_counted_extra_args_need_numbers(extra: list[str], message: str) -> None:
    assert message in str(errors_of({"extra_args": extra})["extra_args"])


@pytest.mark.parametrize("flag", ["--swap-space", "--disable-log-requests",
                                  "--max-seq-len-to-capture", "--num-scheduler-steps"])
def test_flags_vllm_no_longer_takes_are_refused_with_why(flag: str) -> None:
    assert f"vLLM 0.32 has no {flag}" in str(errors_of({"extra_args": [flag, "4"]})[
        "extra_args"])


def test_host_memory_per_gpu_counts_cpu_offload_and_old_swap_space() -> None:
    assert host_memory_gib_per_gpu({"extra_args": ["--cpu-offload-gb", "10"]}) == 10
    assert host_memory_gib_per_gpu({"extra_args": ["--cpu-offload-gb=2.5",
                                                   "--swap-space", "4"]}) == 6.5
    assert host_memory_gib_per_gpu({}) == 0


@pytest.mark.slow
def test_the_installed_vllm_takes_every_allowed_flag() -> None:
    """The allow-list against the real vLLM server's own argument parser: a flag it
    refuses would crash every replica given it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from controlplane.engine_args import EXTRA_ARGS_ALLOWED, EXTRA_ARGS_REMOVED

    parser = make_arg_parser(FlexibleArgumentParser())
    values = {"--generation-config": "auto", "--tokenizer-mode": "auto",
              "--runner": "pooling", "--convert": "embed"}
    for flag, takes_value in EXTRA_ARGS_ALLOWED.items():
        given = [flag, values.get(flag, "2")] if takes_value else [flag]
        parsed = parser.parse_args(["--model", "m", *given])
        assert parsed.model == "m", flag
    for flag in EXTRA_ARGS_REMOVED:
        given = [flag] if flag == "--disable-log-requests" else [flag, "2"]
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", *given])
    line = engine_command_line({"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                               model_path="/m", served_name="s", port=8000)
    assert parser.parse_args(line).pipeline_parallel_size == 2
    embedding = engine_command_line({}, model_path="/m", served_name="s", port=8000,
                                    task="embed")
    assert parser.parse_args(embedding).runner == "pooling"


def test_an_embedding_model_runs_on_the_pooling_runner_unless_extra_args_name_one() -> None:
    line = engine_command_line({}, model_path="/m", served_name="s", port=8000, task="embed")
    assert line[-2:] == ["--runner", "pooling"]
    assert "--runner" not in engine_command_line({}, model_path="/m", served_name="s",
                                                 port=8000)
    chosen = engine_command_line({"extra_args": ["--runner=generate"]}, model_path="/m",
                                 served_name="s", port=8000, task="embed")
    assert [a for a in chosen if a.startswith("--runner")] == ["--runner=generate"]
    assert validate_engine_args({"extra_args": ["--convert", "embed"]})["extra_args"] == [
        "--convert", "embed"]
