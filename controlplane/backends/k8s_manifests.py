"""What the Kubernetes backend applies for a deployment, as plain manifests (dicts): a
Secret holding its engine key, an apps/v1 Deployment running vLLM's OpenAI server, a
headless Service, a PodDisruptionBudget, a NetworkPolicy, a PodMonitor when asked, and,
when the deployment asks for native scaling, an autoscaling/v2 HorizontalPodAutoscaler or
a KEDA ScaledObject. Every object is named by `object_name` and selects by the
deployment's name and the install (`owner_labels`), never by a database id.

Pure functions of the Backend's configuration and the Deployment record: the same inputs
give the same manifests, which is what server-side apply and a no-change resync need.
`manage.py render_manifests <deployment>` prints them as YAML.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import re
from dataclasses import asdict, dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING, Any

from controlplane.backends.base import BackendConfigError

if TYPE_CHECKING:
    from controlplane.models import Deployment

FIELD_MANAGER = "fleetplane"
MANAGED_BY = "fleetplane"
APP_NAME = "vllm"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Which install made an object (settings.INSTALL_ID): in every selector, so two installs
# sharing a namespace never list, adopt or delete each other's objects.
INSTALL_LABEL = "fleetplane.io/install"
DEFAULT_INSTALL_ID = "fleetplane"
ROLE_LABEL = "fleetplane.io/role"
# On the pod template: a new generation (changed engine args, a restart) rolls the pods.
GENERATION_ANNOTATION = "fleetplane.io/generation"
PORT = 8000
MODELS_MOUNT = "/models"
# vLLM reads its --api-key from this variable; the pod takes it from the Secret.
ENGINE_KEY_ENV = "VLLM_API_KEY"
ENGINE_KEY_SUFFIX = "-engine-key"
# The vLLM release the image is pinned to: the one the project runs and tests (its flags,
# --shutdown-timeout among them, are checked against it).
DEFAULT_IMAGE_TAG = "v0.32.0"
# Running + waiting requests per pod native scaling aims at, unless the deployment's
# autoscaling policy has a `queue_per_replica` target (docs/autoscaling.md).
DEFAULT_NATIVE_TARGET = 16.0
# The metric name the HPA reads; a Prometheus adapter rule makes it (docs/autoscaling.md).
HPA_METRIC = "vllm_requests_running_and_waiting"
COLD_START_METRIC = "fleetplane_gateway_cold_start_waiting_requests"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                           r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(?=.{0,63}$)(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")
UNITS = {"": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3,
         "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
         "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
         "Ti": Decimal(2) ** 40}
MODEL_SOURCES = ("pvc", "hostPath", "download")
SCALING = ("controlplane", "hpa", "keda")
WHEN_UNSATISFIABLE = ("ScheduleAnyway", "DoNotSchedule")


@dataclass(frozen=True)
class KubernetesConfig:
    """A kubernetes Backend's `config`, checked."""

    namespace: str
    kubeconfig: str = ""
    context: str = ""
    in_cluster: bool = False
    image: str = "vllm/vllm-openai"
    image_tag: str = DEFAULT_IMAGE_TAG
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str = ""
    gpu_product: str = ""
    #: GPUs one node has: a pod runs on one node, so tensor x pipeline parallel size
    #: above this is refused.
    gpus_per_node: int = 8
    tolerations: tuple[dict[str, Any], ...] = (
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)
    #: Per GPU of the pod (tensor x pipeline parallel size) ...
    cpu_per_gpu: str = "4"
    memory_per_gpu: str = "16Gi"
    shm_per_gpu: str = "2Gi"
    #: ... unless set here for the whole pod (configs stored before the per-GPU values
    #: existed hold these, and keep their sizes).
    cpu: str = ""
    memory: str = ""
    shm_size: str = ""
    model_source: str = "download"
    pvc_name: str = ""
    host_path: str = ""
    hf_token_secret: str = ""
    #: model_source `download`: an emptyDir of this size, or this claim (kept across
    #: restarts; ReadWriteMany when pods of one deployment run on several nodes).
    download_cache_size: str = "100Gi"
    download_cache_pvc: str = ""
    startup_seconds: int = 1800
    termination_grace_seconds: int = 120
    #: Pass vLLM `--shutdown-timeout` so SIGTERM drains in-flight requests instead of
    #: aborting them (vLLM 0.32 has it; an image without the flag needs false).
    drain_on_sigterm: bool = True
    prometheus_address: str = "http://prometheus.monitoring:9090"
    extra_labels: dict[str, str] = field(default_factory=dict)
    #: Who sets the replica count: the control plane (default), or Kubernetes itself
    #: through an HPA or a KEDA ScaledObject on running + waiting requests.
    scaling: str = "controlplane"
    #: Prometheus scrapes the gateway's /metrics: KEDA may then scale to zero, woken by
    #: the requests the gateway holds (the only wake path; without it at least one pod).
    gateway_scraped: bool = False
    #: Render a PodMonitor (Prometheus Operator) scraping the pods' /metrics.
    pod_monitor: bool = False
    #: Topology keys to spread a deployment's pods over (`kubernetes.io/hostname`,
    #: `topology.kubernetes.io/zone`), each with maxSkew 1.
    topology_spread: tuple[str, ...] = ()
    topology_spread_when_unsatisfiable: str = "ScheduleAnyway"
    priority_class_name: str = ""
    #: Rollout: pods above the count (a full GPU pool needs 0 here) and below it.
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    #: Send each new pod one real request before it takes traffic. Needs the control
    #: plane to reach pod IPs (it does when it runs in the cluster).
    warm_up: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, allow_lists: bool = True) -> KubernetesConfig:
        """Check a config. `allow_lists=False` (a config already stored, read to run it)
        leaves the install's allow-lists to `apply`, which reports a refusal on the
        deployment instead of failing every reconcile pass."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BackendConfigError(unknown[0], f"unknown setting; known: "
                                                 f"{', '.join(sorted(known))}")
        namespace = raw.get("namespace")
        if not isinstance(namespace, str) or not DNS_LABEL.match(namespace):
            raise BackendConfigError("namespace", "required: a DNS label such as `inference`")
        values: dict[str, Any] = {"namespace": namespace}
        for name in ("kubeconfig", "context", "image", "image_tag", "service_account",
                     "gpu_product", "pvc_name", "host_path", "hf_token_secret",
                     "prometheus_address", "download_cache_pvc", "priority_class_name"):
            if name in raw:
                if not isinstance(raw[name], str):
                    raise BackendConfigError(name, "must be a string")
                values[name] = raw[name]
        if not IMAGE_TAG.match(values.get("image_tag", DEFAULT_IMAGE_TAG)):
            raise BackendConfigError("image_tag", "must be an image tag such as "
                                                  f"`{DEFAULT_IMAGE_TAG}`")
        for name in ("download_cache_pvc", "pvc_name"):
            if values.get(name) and not DNS_SUBDOMAIN.match(values[name]):
                raise BackendConfigError(name, "must be a PersistentVolumeClaim name")
        priority = values.get("priority_class_name", "")
        if priority and (not DNS_SUBDOMAIN.match(priority) or priority.startswith("system-")):
            raise BackendConfigError("priority_class_name", "must name a PriorityClass "
                                                            "(not a `system-` one)")
        for name in ("in_cluster", "warm_up", "drain_on_sigterm", "gateway_scraped",
                     "pod_monitor"):
            if name in raw:
                if not isinstance(raw[name], bool):
                    raise BackendConfigError(name, "must be true or false")
                values[name] = raw[name]
        for name, choices in (("scaling", SCALING),
                              ("topology_spread_when_unsatisfiable", WHEN_UNSATISFIABLE)):
            if name in raw:
                if raw[name] not in choices:
                    raise BackendConfigError(name, f"one of {', '.join(choices)}")
                values[name] = raw[name]
        for name in ("cpu", "memory", "shm_size", "cpu_per_gpu", "memory_per_gpu",
                     "shm_per_gpu", "download_cache_size"):
            if name in raw:
                value = raw[name]
                blank_ok = name in ("cpu", "memory", "shm_size")
                if blank_ok and value == "":
                    values[name] = ""
                    continue
                if isinstance(value, bool) or not isinstance(value, str | int) or \
                        not QUANTITY.match(str(value)) or not quantity(str(value)):
                    raise BackendConfigError(name, "must be a Kubernetes quantity above 0 "
                                                   "such as `8`, `500m` or `32Gi`")
                values[name] = str(value)
        for name, low, high in (("startup_seconds", 60, 86_400),
                                ("termination_grace_seconds", 10, 86_400),
                                ("gpus_per_node", 1, 64)):
            if name in raw:
                value = raw[name]
                if isinstance(value, bool) or not isinstance(value, int) or \
                        not low <= value <= high:
                    raise BackendConfigError(name, f"must be a whole number from {low} to "
                                                   f"{high}")
                values[name] = value
        for name in ("max_surge", "max_unavailable"):
            if name in raw:
                values[name] = rollout_step(name, raw[name])
        if not rollout_size(values.get("max_surge", 1)) and not rollout_size(
                values.get("max_unavailable", 0)):
            raise BackendConfigError("max_unavailable", "max_surge and max_unavailable may "
                                                        "not both be 0: a rollout could "
                                                        "never start")
        if "image_pull_secrets" in raw:
            secrets = raw["image_pull_secrets"]
            if not isinstance(secrets, list) or not all(
                    isinstance(s, str) and DNS_SUBDOMAIN.match(s) for s in secrets):
                raise BackendConfigError("image_pull_secrets", "must be a list of Secret names")
            values["image_pull_secrets"] = tuple(secrets)
        if "tolerations" in raw:
            tolerations = raw["tolerations"]
            if not isinstance(tolerations, list) or not all(isinstance(t, dict)
                                                            for t in tolerations):
                raise BackendConfigError("tolerations", "must be a list of tolerations")
            values["tolerations"] = tuple(tolerations)
        if "topology_spread" in raw:
            keys = raw["topology_spread"]
            if not isinstance(keys, list) or not all(
                    isinstance(k, str) and is_label_key(k) for k in keys) or \
                    len(set(keys)) != len(keys):
                raise BackendConfigError("topology_spread", "must be a list of distinct node "
                                                            "label keys such as "
                                                            "`kubernetes.io/hostname`")
            values["topology_spread"] = tuple(keys)
        if "extra_labels" in raw:
            labels = raw["extra_labels"]
            if not isinstance(labels, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
                raise BackendConfigError("extra_labels", "must map strings to strings")
            for key, value in labels.items():
                if not is_label_key(key) or not LABEL_VALUE.match(value):
                    raise BackendConfigError("extra_labels", f"{key}={value} is not a "
                                                             f"Kubernetes label")
            values["extra_labels"] = dict(labels)
        source = raw.get("model_source", "download")
        if source not in MODEL_SOURCES:
            raise BackendConfigError("model_source", f"one of {', '.join(MODEL_SOURCES)}")
        values["model_source"] = source
        if source == "pvc" and not values.get("pvc_name"):
            raise BackendConfigError("pvc_name", "required with model_source `pvc`: the "
                                                 "PersistentVolumeClaim holding the models")
        if source == "hostPath" and not str(values.get("host_path", "")).startswith("/"):
            raise BackendConfigError("host_path", "required with model_source `hostPath`: "
                                                  "an absolute path on the nodes")
        if allow_lists:
            check_allowed(values)
        return cls(**values)

    def as_dict(self) -> dict[str, object]:
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in asdict(self).items()}


def is_label_key(key: str) -> bool:
    """A Kubernetes label key: `name` or `prefix/name`, the prefix a DNS subdomain."""
    prefix, slash, name = key.rpartition("/")
    return bool(LABEL_NAME.match(name)) and (not slash or bool(DNS_SUBDOMAIN.match(prefix)))


def rollout_step(name: str, value: Any) -> int | str:
    """max_surge / max_unavailable: a whole number of pods or a percentage."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1000:
        return value
    if isinstance(value, str) and PERCENT.match(value):
        return value
    raise BackendConfigError(name, "must be a whole number of pods (0 or more) or a "
                                   "percentage such as `25%`")


def rollout_size(value: int | str) -> int:
    return int(str(value).rstrip("%"))


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity (as QUANTITY matches it) as a number: cores or bytes."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or match.group(2) not in UNITS:
        raise BackendConfigError("quantity", f"{text!r} is not a quantity")
    return Decimal(match.group(1)) * UNITS[match.group(2)]


def cpu_text(cores: Decimal) -> str:
    millis = int((cores * 1000).to_integral_value(rounding=ROUND_CEILING))
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def memory_text(size: Decimal) -> str:
    mebibytes = int((size / UNITS["Mi"]).to_integral_value(rounding=ROUND_CEILING))
    return f"{mebibytes // 1024}Gi" if mebibytes % 1024 == 0 else f"{mebibytes}Mi"


def check_allowed(values: dict[str, Any]) -> None:
    """What this install's settings allow (docs/security.md): the image, the node path a
    pod may mount, the service account; and a pinned image tag. An admin key configures
    within these bounds."""
    from django.conf import settings

    image = str(values.get("image", KubernetesConfig.image))
    tag = str(values.get("image_tag", KubernetesConfig.image_tag))
    if tag == "latest":
        raise BackendConfigError("image_tag", f"`latest` is not pinned: a restarted pod "
                                              f"could run another vLLM than its neighbours; "
                                              f"name a release such as {DEFAULT_IMAGE_TAG}")
    allowed = set(settings.KUBERNETES_ALLOWED_IMAGES)
    if image not in allowed and f"{image}:{tag}" not in allowed:
        raise BackendConfigError("image", f"{image}:{tag} is not an image this install "
                                          f"allows (KUBERNETES_ALLOWED_IMAGES)")
    host_path = str(values.get("host_path", ""))
    if host_path:
        path = posixpath.normpath(host_path)
        if ".." in host_path.split("/") or not any(
                path == prefix or path.startswith(prefix.rstrip("/") + "/")
                for prefix in settings.KUBERNETES_ALLOWED_HOST_PATHS):
            raise BackendConfigError("host_path", f"{host_path!r} is not under a node path "
                                                  f"this install allows "
                                                  f"(KUBERNETES_ALLOWED_HOST_PATHS)")
    account = str(values.get("service_account", ""))
    if account and account not in settings.KUBERNETES_ALLOWED_SERVICE_ACCOUNTS:
        raise BackendConfigError("service_account", f"{account!r} is not a service account "
                                                    f"this install allows "
                                                    f"(KUBERNETES_ALLOWED_SERVICE_ACCOUNTS)")


# --- names and labels ------------------------------------------------------------------

def install_id() -> str:
    from django.conf import settings

    return str(settings.INSTALL_ID)


def managed_labels() -> dict[str, str]:
    """What every object this install manages carries: the selector for listing them all."""
    return {MANAGED_BY_LABEL: MANAGED_BY, INSTALL_LABEL: install_id()}


def object_name(deployment_name: str) -> str:
    """The name of every object made for a deployment: a DNS-1035 label (what a Service
    needs: a lower-case letter first, at most 63 characters), so also a valid DNS-1123
    subdomain for the other kinds and a valid label value. An install other than the
    default is prefixed (`<install>-<name>`). A name that does not fit as it is (`8b-chat`,
    `My_Chat`, too long) is made to: lower-cased, other characters turned to `-`, `d-`
    put before a leading digit, cut to fit, and ended with `-` and 8 hex digits of the
    SHA-256 of the untransformed name, so two names never meet (`8b-chat` ->
    `d-8b-chat-<hash>`). The same name always gives the same result."""
    install = install_id()
    base = deployment_name if install == DEFAULT_INSTALL_ID else f"{install}-{deployment_name}"
    if DNS_1035_LABEL.match(base):
        return base
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    cleaned = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", base.lower())).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"d-{cleaned}".rstrip("-")
    return f"{cleaned[:63 - len(digest) - 1].rstrip('-')}-{digest}"


def deployment_key(deployment: Deployment) -> str:
    """The deployment's value of INSTANCE_LABEL: how the backend groups what it lists."""
    return object_name(deployment.name)


def owner_labels(deployment: Deployment) -> dict[str, str]:
    """The labels every object made for a deployment carries, and selects by: the name and
    the install, both stable across a database rebuild (not the database id)."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: deployment_key(deployment),
        **managed_labels(),
    }


def selector_changed(live: dict[str, Any], rendered: dict[str, Any]) -> bool:
    """True when a Deployment in the cluster selects otherwise than the rendered one.
    `spec.selector` is immutable: such a Deployment (applied by an older version, which
    selected by the database id) must be deleted and created again, not applied over."""
    if live.get("kind") != "Deployment" or rendered.get("kind") != "Deployment":
        return False
    wanted = rendered["spec"]["selector"]
    found = (live.get("spec") or {}).get("selector") or {}
    return bool((found.get("matchLabels") or {}) != wanted.get("matchLabels", {}) or
                (found.get("matchExpressions") or []) != wanted.get("matchExpressions", []))


# --- the pods ---------------------------------------------------------------------------

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


def container(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    from controlplane.engine_args import engine_command_line

    sizes = resources(deployment, config)
    args = engine_command_line(deployment.engine_args or {},
                               model_path=model_argument(deployment, config),
                               served_name=deployment.served_model_name(), port=PORT,
                               host="0.0.0.0")
    pre_stop, drain = shutdown_timing(config)
    if config.drain_on_sigterm:
        args += ["--shutdown-timeout", str(drain)]
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
        "env": env,
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


def metadata(deployment: Deployment, config: KubernetesConfig, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": config.namespace,
            "labels": {**config.extra_labels, **owner_labels(deployment)}}


def render(deployment: Deployment, config: KubernetesConfig, scaling: str = "",
           replicas: int | None = None) -> list[dict[str, Any]]:
    """Every object the backend applies for this deployment, in apply order.

    `scaling` (default: the configuration's) `hpa` or `keda` adds Kubernetes' own scaling
    on running + waiting requests and leaves `spec.replicas` out, so the two never fight
    over it; `controlplane` sets `replicas` (default: the desired active count plus the
    warm standby pool). New pods are labelled `active`, but take no traffic before the
    control plane has seen them ready and warmed them up; it then relabels the ones beyond
    the desired active count `standby` (the same template for every pod: a change of the
    standby count restarts nothing)."""
    scaling = scaling or config.scaling
    if scaling not in SCALING:
        raise BackendConfigError("scaling", f"one of {', '.join(SCALING)}")
    if not deployment.desired_replicas() + deployment.desired_standby():
        scaling = "controlplane"  # stopped, deleting or at zero: no autoscaler, no pods
    selector = owner_labels(deployment)
    name = object_name(deployment.name)
    spec: dict[str, Any] = {}
    if scaling == "controlplane":
        spec["replicas"] = (deployment.desired_replicas() + deployment.desired_standby()
                            if replicas is None else replicas)
    objects: list[dict[str, Any]] = [
        engine_key_secret(deployment, config),
        {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(deployment, config, name),
            "spec": {
                **spec,
                "selector": {"matchLabels": selector},
                # Default one pod at a time, never below the desired count (a GPU pod is
                # slow to start and expensive to lose); a full GPU pool needs max_surge 0
                # and max_unavailable 1 or more.
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxSurge": config.max_surge,
                                               "maxUnavailable": config.max_unavailable}},
                "template": {
                    "metadata": {
                        "labels": {**config.extra_labels, **selector, ROLE_LABEL: "active"},
                        "annotations": {GENERATION_ANNOTATION: str(deployment.generation)}},
                    "spec": pod_spec(deployment, config),
                },
            },
        },
        {
            "apiVersion": "v1", "kind": "Service",
            "metadata": metadata(deployment, config, name),
            "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses":
                     False, "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                                       "protocol": "TCP"}]},
        },
        {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(deployment, config, name),
            # Evictions (node drains) may take as many pods at once as a rollout does,
            # and at least one: a budget of 0 would block every drain.
            "spec": {"maxUnavailable": config.max_unavailable if rollout_size(
                         config.max_unavailable) else 1,
                     "selector": {"matchLabels": selector}},
        },
        network_policy(deployment, config),
    ]
    if config.pod_monitor:
        objects.append(pod_monitor(deployment, config))
    if scaling == "hpa":
        objects.append(hpa(deployment, config))
    elif scaling == "keda":
        objects.append(scaled_object(deployment, config))
    return objects


def engine_key_secret_name(deployment: Deployment) -> str:
    return f"{object_name(deployment.name)}{ENGINE_KEY_SUFFIX}"


def engine_key_secret(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """The deployment's engine key, as the Secret its pods read it from (applied first,
    so no pod starts without it)."""
    key = base64.b64encode(deployment.engine_key().encode()).decode()
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": metadata(deployment, config, engine_key_secret_name(deployment)),
        "data": {ENGINE_KEY_ENV: key},
    }


def network_policy(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Only the gateway and the controllers (and Prometheus, where its labels are set)
    reach the replica port: the engine key is one lock, this is the second, and it also
    covers /metrics and /health, which vLLM serves without a key."""
    from django.conf import settings

    def peer(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": namespace}},
                "podSelector": {"matchLabels": dict(labels)}}

    namespace = settings.KUBERNETES_CONTROL_PLANE_NAMESPACE
    peers = [peer(namespace, settings.KUBERNETES_GATEWAY_POD_LABELS),
             peer(namespace, settings.KUBERNETES_CONTROLLER_POD_LABELS)]
    if settings.KUBERNETES_PROMETHEUS_POD_LABELS:
        peers.append(peer(settings.KUBERNETES_PROMETHEUS_NAMESPACE,
                          settings.KUBERNETES_PROMETHEUS_POD_LABELS))
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"podSelector": {"matchLabels": owner_labels(deployment)},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": PORT}]}]},
    }


def pod_monitor(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """A Prometheus Operator PodMonitor for the pods' /metrics (Prometheus must also be
    admitted by the NetworkPolicy: KUBERNETES_PROMETHEUS_POD_LABELS)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": metadata(deployment, config, object_name(deployment.name)),
        "spec": {"selector": {"matchLabels": owner_labels(deployment)},
                 "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}],
                 # The series then say which deployment and install they belong to.
                 "podTargetLabels": [INSTANCE_LABEL, INSTALL_LABEL]},
    }


def native_target(deployment: Deployment) -> float:
    """Running + waiting requests per pod that native scaling aims at: the deployment's
    `queue_per_replica` target (requests in flight per replica) when its policy has one."""
    for signal in (deployment.autoscaling or {}).get("signals") or []:
        if signal.get("name") == "queue_per_replica":
            return float(signal["target"])
    return DEFAULT_NATIVE_TARGET


def wakes_from_zero(deployment: Deployment, config: KubernetesConfig) -> bool:
    """Whether a request can bring this deployment back from zero pods: the gateway holds
    requests for it (its autoscaling policy is enabled) and Prometheus scrapes the count."""
    return config.gateway_scraped and bool((deployment.autoscaling or {}).get("enabled"))


def number(value: float) -> str:
    return f"{value:g}"


def hpa(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling on running + waiting requests per pod (a Prometheus adapter rule
    serves HPA_METRIC as a pods metric: docs/autoscaling.md). An HPA does not scale to
    zero, so at least one pod."""
    name = object_name(deployment.name)
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(deployment, config, name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": max(1, deployment.min_replicas),
            "maxReplicas": max(1, deployment.max_replicas, deployment.min_replicas),
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": HPA_METRIC},
                "target": {"type": "AverageValue",
                           "averageValue": number(native_target(deployment))}}}],
        },
    }


def scaled_object(deployment: Deployment, config: KubernetesConfig) -> dict[str, Any]:
    """Native scaling through KEDA's Prometheus scaler on running + waiting requests, with
    the HPA's target. To zero only when a request can wake it: then a second trigger on
    the requests the gateway holds for it activates the deployment at the first one."""
    from django.conf import settings

    where = (f'namespace="{config.namespace}",'
             f'model_name="{deployment.served_model_name()}"')
    load = (f"(sum(vllm:num_requests_running{{{where}}}) or vector(0)) + "
            f"(sum(vllm:num_requests_waiting{{{where}}}) or vector(0))")
    target = number(native_target(deployment))
    triggers: list[dict[str, Any]] = [{"type": "prometheus", "metadata": {
        "serverAddress": config.prometheus_address, "query": load, "threshold": target}}]
    wakes = wakes_from_zero(deployment, config)
    if wakes:
        held = (f'sum({COLD_START_METRIC}{{namespace='
                f'"{settings.KUBERNETES_CONTROL_PLANE_NAMESPACE}",'
                f'deployment="{deployment.name}"}}) or vector(0)')
        triggers.append({"type": "prometheus", "metadata": {
            "serverAddress": config.prometheus_address, "query": held,
            "threshold": target, "activationThreshold": "0"}})
    name = object_name(deployment.name)
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": metadata(deployment, config, name),
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": deployment.min_replicas if wakes else max(
                1, deployment.min_replicas),
            "maxReplicaCount": max(1, deployment.max_replicas, deployment.min_replicas),
            "triggers": triggers,
        },
    }


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as YAML for a person to read: a Secret's values are left out (the
    engine key is never shown after it is made; the control plane applies it itself)."""
    import yaml

    shown = [{**{k: v for k, v in obj.items() if k != "data"},
              "stringData": dict.fromkeys(obj.get("data") or {}, "(hidden: applied by the "
                                                                 "control plane)")}
             if obj["kind"] == "Secret" else obj for obj in objects]
    return "".join("---\n" + yaml.safe_dump(obj, sort_keys=False) for obj in shown)
