"""vLLM server options a deployment may set: typed, validated, turned into a command line.

Options are checked on their own (types, ranges, choices, an allow-list for extra flags) and
against the model (max_model_len within its context, tensor parallel size dividing its
attention heads).
"""

from __future__ import annotations

import re
from typing import Any

from rest_framework import serializers

from models_registry.models import Model

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", "gguf", "marlin")
SCHEDULING_POLICIES = ("fcfs", "priority")
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

# Extra flags a deployment may pass through, and whether each takes a value.
EXTRA_ARGS_ALLOWED: dict[str, bool] = {
    "--enforce-eager": False,
    "--seed": True,
    "--block-size": True,
    "--max-logprobs": True,
    "--disable-log-stats": False,
    "--enable-chunked-prefill": False,
    "--no-enable-chunked-prefill": False,
    "--generation-config": True,
    "--tokenizer-mode": True,
    # Kept for clients that sent it before the `pipeline_parallel_size` arg existed.
    "--pipeline-parallel-size": True,
    # GiB of weights per GPU held in host memory (vLLM 0.32's UVAOffloadConfig): the
    # Kubernetes backend adds it to the pod's memory.
    "--cpu-offload-gb": True,
    # vLLM 0.32's model runner ("generate", "pooling") and conversion of a model to another
    # task ("embed", "classify", ...). The control plane passes `--runner pooling` itself
    # for a model registered as an embedding model.
    "--runner": True,
    "--convert": True,
}
# Flags earlier vLLM releases took and vLLM 0.32 (the version the project runs and the
# Kubernetes image it pins) refuses at start-up: refused here, with why, rather than
# left to crash the server.
EXTRA_ARGS_REMOVED: dict[str, str] = {
    "--swap-space": "vLLM 0.32 has no --swap-space (the CPU swap space was removed)",
    "--disable-log-requests": "vLLM 0.32 has no --disable-log-requests (requests are not "
                              "logged unless --enable-log-requests is given)",
    "--max-seq-len-to-capture": "vLLM 0.32 has no --max-seq-len-to-capture",
    "--num-scheduler-steps": "vLLM 0.32 has no --num-scheduler-steps",
}
MAX_EXTRA_ARGS = 32
SAFE_VALUE = re.compile(r"^[A-Za-z0-9._:/=+-]{1,200}$")


class EngineArgsSerializer(serializers.Serializer):
    max_model_len = serializers.IntegerField(min_value=16, max_value=10_000_000, required=False)
    dtype = serializers.ChoiceField(choices=DTYPES, required=False)
    gpu_memory_utilization = serializers.FloatField(min_value=0.05, max_value=0.99,
                                                    required=False)
    enable_prefix_caching = serializers.BooleanField(required=False)
    tensor_parallel_size = serializers.IntegerField(min_value=1, max_value=64, required=False)
    pipeline_parallel_size = serializers.IntegerField(min_value=1, max_value=64,
                                                      required=False)
    max_num_seqs = serializers.IntegerField(min_value=1, max_value=16_384, required=False)
    max_num_batched_tokens = serializers.IntegerField(min_value=16, max_value=10_000_000,
                                                      required=False)
    kv_cache_dtype = serializers.ChoiceField(choices=KV_CACHE_DTYPES, required=False)
    quantization = serializers.ChoiceField(choices=QUANTIZATIONS, required=False)
    scheduling_policy = serializers.ChoiceField(choices=SCHEDULING_POLICIES, required=False)
    served_model_name = serializers.RegexField(SERVED_NAME, required=False,
                                               error_messages={"invalid": "use letters, "
                                                               "digits and . _ : / -"})
    extra_args = serializers.ListField(child=serializers.CharField(max_length=200),
                                       max_length=MAX_EXTRA_ARGS, required=False)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise serializers.ValidationError("engine_args must be an object")
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: ["unknown engine argument; put other vLLM flags in extra_args"]
                 for name in unknown}
            )
        return super().to_internal_value(data)

    def validate_extra_args(self, value: list[str]) -> list[str]:
        index = 0
        while index < len(value):
            flag = value[index]
            name, has_inline, inline_value = flag.partition("=")
            if name in EXTRA_ARGS_REMOVED:
                raise serializers.ValidationError(f"{name}: {EXTRA_ARGS_REMOVED[name]}")
            if name not in EXTRA_ARGS_ALLOWED:
                raise serializers.ValidationError(
                    f"{name!r} is not an allowed extra argument (allowed: "
                    f"{', '.join(sorted(EXTRA_ARGS_ALLOWED))})"
                )
            takes_value = EXTRA_ARGS_ALLOWED[name]
            if takes_value and not has_inline:
                index += 1
                if index >= len(value) or value[index].startswith("--"):
                    raise serializers.ValidationError(f"{name} needs a value")
                inline_value = value[index]
            elif not takes_value and has_inline:
                raise serializers.ValidationError(f"{name} takes no value")
            if takes_value and not SAFE_VALUE.match(inline_value):
                raise serializers.ValidationError(f"the value of {name} has unsafe characters")
            index += 1
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        extra = attrs.get("extra_args") or []
        if "pipeline_parallel_size" in attrs and extra_flag_value(
                extra, "--pipeline-parallel-size") is not None:
            raise serializers.ValidationError({"pipeline_parallel_size": [
                "given twice: as pipeline_parallel_size and as --pipeline-parallel-size in "
                "extra_args; keep pipeline_parallel_size"]})
        for flag, parse, low, wanted in (
                ("--pipeline-parallel-size", int, 1, "a whole number, 1 or more"),
                ("--cpu-offload-gb", float, 0, "a number of GiB per GPU, 0 or more")):
            value = extra_flag_value(extra, flag)
            if value is None:
                continue
            try:
                number = parse(value)
            except ValueError:
                number = low - 1
            if not low <= number <= 100_000:
                raise serializers.ValidationError({"extra_args": [f"{flag} needs {wanted}"]})
        return attrs


def extra_flag_value(extra_args: list[str], flag: str) -> str | None:
    """The value given to `flag` in extra_args (`--flag V` or `--flag=V`), or None."""
    for index, item in enumerate(extra_args):
        name, has_inline, inline_value = item.partition("=")
        if name != flag:
            continue
        if has_inline:
            return inline_value
        return extra_args[index + 1] if index + 1 < len(extra_args) else None
    return None


def parallel_sizes(args: dict[str, Any]) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes: the pipeline size from its arg or, for engine
    args stored before that arg existed, from extra_args."""
    tensor = int(args.get("tensor_parallel_size") or 1)
    pipeline = args.get("pipeline_parallel_size") or extra_flag_value(
        list(args.get("extra_args") or []), "--pipeline-parallel-size") or 1
    return tensor, int(pipeline)


def gpu_count(args: dict[str, Any]) -> int:
    """GPUs one server uses: tensor parallel size times pipeline parallel size."""
    tensor, pipeline = parallel_sizes(args)
    return tensor * pipeline


def host_memory_gib_per_gpu(args: dict[str, Any]) -> float:
    """Host memory the engine takes per GPU beyond its own: `--cpu-offload-gb` (weights
    kept in host memory, GiB per GPU) and `--swap-space` (GiB per GPU in the vLLM
    releases that had it; stored args may still carry it)."""
    extra = list(args.get("extra_args") or [])
    total = 0.0
    for flag in ("--cpu-offload-gb", "--swap-space"):
        value = extra_flag_value(extra, flag)
        try:
            total += max(0.0, float(value)) if value is not None else 0.0
        except ValueError:
            continue
    return total


def validate_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """Check engine args on their own; raises serializers.ValidationError naming fields."""
    serializer = EngineArgsSerializer(data=args)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def engine_args_misfit(args: dict[str, Any], model: Model) -> dict[str, str]:
    """Reasons the args cannot work with this model, by field (empty when they can)."""
    problems: dict[str, str] = {}
    max_len = args.get("max_model_len")
    if max_len and model.context_length and max_len > model.context_length:
        problems["max_model_len"] = (f"{max_len} is above the context length of "
                                     f"{model.name} ({model.context_length})")
    tp = args.get("tensor_parallel_size")
    if tp and model.num_attention_heads and model.num_attention_heads % tp:
        problems["tensor_parallel_size"] = (
            f"{tp} does not divide the {model.num_attention_heads} attention heads of "
            f"{model.name}"
        )
    return problems


def engine_command_line(args: dict[str, Any], *, model_path: str, served_name: str,
                        port: int, host: str = "127.0.0.1", task: str = "generate"
                        ) -> list[str]:
    """The arguments after `python -m vllm.entrypoints.openai.api_server`; an embedding
    model (`task` "embed") runs on vLLM's pooling runner unless extra_args name one."""
    line = ["--model", model_path, "--served-model-name", served_name, "--host", host,
            "--port", str(port)]
    for key in ("max_model_len", "dtype", "gpu_memory_utilization", "tensor_parallel_size",
                "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                "kv_cache_dtype", "quantization", "scheduling_policy"):
        if args.get(key) is not None:
            line += [f"--{key.replace('_', '-')}", str(args[key])]
    if args.get("enable_prefix_caching") is True:
        line.append("--enable-prefix-caching")
    elif args.get("enable_prefix_caching") is False:
        line.append("--no-enable-prefix-caching")
    extra = list(args.get("extra_args") or [])
    if task == "embed" and extra_flag_value(extra, "--runner") is None:
        line += ["--runner", "pooling"]
    return line + extra
