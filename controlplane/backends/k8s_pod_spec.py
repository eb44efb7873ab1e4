"""The pod a Kubernetes deployment runs: vLLM's container (arguments, environment,
probes, the drain on SIGTERM), its volumes, and its size: GPUs from tensor x pipeline
parallel size, CPU, memory and /dev/shm per GPU unless set for the pod."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING, Any

from controlplane.backends.base import BackendConfigError
from controlplane.backends.k8s_config import UNITS, KubernetesConfig, quantity
from controlplane.backends.k8s_names import engine_key_secret_name, owner_labels

if TYPE_CHECKING:
    from controlplane.models import Deployment

PORT = 8000
MODELS_MOUNT = "/models"
# vLLM reads its --api-key from this variable; the pod takes it from the Secret.
ENGINE_KEY_ENV = "VLLM_API_KEY"


def cpu_text(cores: Decimal) -> str:
    """Cores as a Kubernetes quantity, rounded up to a millicore."""
    millis = int((cores * 1000).to_integral_value(rounding=ROUND_CEILING))
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def memory_text(size: Decimal) -> str:
    """Bytes as a Kubernetes quantity, rounded up to a mebibyte (Gi when whole)."""
    mebibytes = int((size / UNITS["Mi"]).to_integral_value(rounding=ROUND_CEILING))
    return f"{mebibytes // 1024}Gi" if mebibytes % 1024 == 0 else f"{mebibytes}Mi"


def gpus_for(deployment: Deployment, config: KubernetesConfig | None = None) -> int:
    """GPUs a pod asks for: tensor x pipeline parallel size; refused above a node's."""
    from controlplane.engine_args import parallel_sizes

    try:
        tensor, pipeline = parallel_sizes(deployment.engine_args or {})
    except ValueError:
        raise BackendConfigError("engine_args.pipeline_parallel_size",
                                 "must be a whole number") from None
    gpus = tensor * pipeline
    if config is not None and gpus > config.gpus_per_node:
        raise BackendConfigError(
            "engine_args.tensor_parallel_size",
            f"tensor_parallel_size {tensor} x pipeline_parallel_size {pipeline} = {gpus} "
            f"GPUs, more than the {config.gpus_per_node} a node has (gpus_per_node): a pod "
            f"runs on one node")
    return gpus


def resources(deployment: Deployment, config: KubernetesConfig) -> dict[str, str]:
    """CPU and memory of a pod (requests = limits), and its /dev/shm size: per GPU unless
    set for the pod. Memory also holds /dev/shm (memory-backed, charged to the pod) and
    the host memory `--cpu-offload-gb` (and an old `--swap-space`) take per GPU."""
    from controlplane.engine_args import host_memory_gib_per_gpu

    gpus = gpus_for(deployment, config)
    cpu = quantity(config.cpu) if config.cpu else quantity(config.cpu_per_gpu) * gpus
    shm = quantity(config.shm_size) if config.shm_size else quantity(
        config.shm_per_gpu) * gpus
    own = quantity(config.memory) if config.memory else quantity(config.memory_per_gpu) * gpus
    host = Decimal(str(host_memory_gib_per_gpu(deployment.engine_args or {}))) * gpus
    return {"cpu": cpu_text(cpu), "memory": memory_text(own + shm + host * UNITS["Gi"]),
            "shm": memory_text(shm), "gpus": str(gpus)}


def shutdown_timing(config: KubernetesConfig) -> tuple[int, int]:
    """(preStop sleep, vLLM --shutdown-timeout) within terminationGracePeriodSeconds:
    the sleep keeps the pod serving while it leaves the route table and the Service's
    endpoints; then SIGTERM, and vLLM drains what is still in flight for the timeout;
    10 s stay for its teardown before SIGKILL."""
    grace = config.termination_grace_seconds
    pre_stop = min(30, max(5, grace // 4))
    return pre_stop, max(1, grace - pre_stop - 10)


def model_argument(deployment: Deployment, config: KubernetesConfig) -> str:
    """What `--model` names inside the pod."""
    model = deployment.model
    if config.model_source == "download":
        if model.source != "huggingface":
            raise BackendConfigError(
                "model_source", f"the model {model.name} is not a Hugging Face id, so pods "
                                f"cannot download it: use model_source `pvc` or `hostPath`")
        return str(model.source_uri)
    return f"{MODELS_MOUNT}/{model.name}"


def environment(deployment: Deployment, config: KubernetesConfig) -> list[dict[str, Any]]:
    """vLLM's environment: the engine key from its Secret, and where models come from."""
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        # vLLM then refuses /v1/* without `Authorization: Bearer <key>`.
        {"name": ENGINE_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": engine_key_secret_name(deployment), "key": ENGINE_KEY_ENV}}},
    ]
    if config.model_source == "download":
        env.append({"name": "HF_HOME", "value": f"{MODELS_MOUNT}/.hf"})
        if config.hf_token_secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": config.hf_token_secret, "key": "HF_TOKEN"}}})
    else:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return env


def container(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """vLLM's container: its arguments, environment, sizes, probes and stop."""
    from controlplane.engine_args import engine_command_line

    sizes = resources(deployment, config)
    args = engine_command_line(deployment.engine_args or {},
                               model_path=model_argument(deployment, config),
                               served_name=deployment.served_model_name(), port=PORT,
                               host="0.0.0.0", task=deployment.model.task)
    pre_stop, drain = shutdown_timing(config)
    if config.drain_on_sigterm:
        args += ["--shutdown-timeout", str(drain)]
    limits: dict[str, str] = {"cpu": sizes["cpu"], "memory": sizes["memory"],
                              "nvidia.com/gpu": sizes["gpus"]}
    requests = dict(limits)
    if config.model_source == "download" and not config.download_cache_pvc:
        # The download lands on the node's disk: schedule where it fits.
        requests["ephemeral-storage"] = config.download_cache_size
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "name": "vllm",
        "image": f"{config.image}:{config.image_tag}",
        "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": environment(deployment, config),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         # The pods only read weights a volume holds; a download writes.
                         {"name": "models", "mountPath": MODELS_MOUNT,
                          "readOnly": config.model_source != "download"}],
        # Loading a large model takes long: the startup probe allows startup_seconds.
        # Readiness takes the pod out of the Service's endpoints, liveness restarts it: a
        # loaded engine can answer /health slowly, so readiness waits 3 misses of 5 s
        # (about 30 s) and liveness 6 misses of 10 s (about 2 min).
        "startupProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": max(1, config.startup_seconds // 10)},
        "readinessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 20, "timeoutSeconds": 10,
                          "failureThreshold": 6},
        # Before SIGTERM: the pod keeps serving while it leaves the endpoints and the
        # route table; then vLLM drains (--shutdown-timeout) within the grace period.
        "lifecycle": {"preStop": {"sleep": {"seconds": pre_stop}}},
        # Pod Security "baseline" and the parts of "restricted" vLLM can meet (it runs as
        # root in the official image, so runAsNonRoot is left to the image's owner).
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def models_volume(config: KubernetesConfig) -> dict[str, Any]:
    """The volume the models are read from, or downloaded to."""
    if config.model_source == "pvc":
        return {"name": "models", "persistentVolumeClaim": {"claimName": config.pvc_name,
                                                            "readOnly": True}}
    if config.model_source == "hostPath":
        return {"name": "models", "hostPath": {"path": config.host_path,
                                               "type": "Directory"}}
    if config.download_cache_pvc:
        return {"name": "models", "persistentVolumeClaim": {
            "claimName": config.download_cache_pvc}}
    return {"name": "models", "emptyDir": {"sizeLimit": config.download_cache_size}}


def pod_spec(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """The pod template's spec: the container, volumes, placement and security."""
    spec: dict[str, Any] = {
        "containers": [container(deployment, config)],
        "volumes": [{"name": "shm", "emptyDir": {
            "medium": "Memory", "sizeLimit": resources(deployment, config)["shm"]}},
                    models_volume(config)],
        "terminationGracePeriodSeconds": config.termination_grace_seconds,
        "tolerations": [dict(t) for t in config.tolerations],
        "enableServiceLinks": False,
        # vLLM never calls the Kubernetes API: a token in the pod is only something to steal.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    if config.gpu_product:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "nvidia.com/gpu.product", "operator": "In",
                "values": [config.gpu_product]}]}]}}}
    if config.topology_spread:
        spec["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": key,
            "whenUnsatisfiable": config.topology_spread_when_unsatisfiable,
            "labelSelector": {"matchLabels": owner_labels(deployment)},
            # Counted per revision: a rollout's new pods spread among themselves.
            "matchLabelKeys": ["pod-template-hash"]} for key in config.topology_spread]
    if config.priority_class_name:
        spec["priorityClassName"] = config.priority_class_name
    if config.service_account:
        spec["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    return spec
