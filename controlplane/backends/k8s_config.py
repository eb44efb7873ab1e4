"""A kubernetes Backend's `config`, checked (`KubernetesConfig.from_dict`): each setting's
type and form from one table, then the rules between settings, then what this install's
allow-lists permit (`check_allowed`)."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from controlplane.backends.base import BackendConfigError

# The vLLM release the image is pinned to: the one the project runs and tests (its flags,
# --shutdown-timeout among them, are checked against it).
DEFAULT_IMAGE_TAG = "v0.32.0"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
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
        # In this order: the first setting found wrong is the one reported.
        values: dict[str, Any] = {"namespace": namespace, **checked(raw, TEXT_FIELDS)}
        check_names(values)
        values.update(checked(raw, SETTING_FIELDS))
        if not rollout_size(values.get("max_surge", 1)) and not rollout_size(
                values.get("max_unavailable", 0)):
            raise BackendConfigError("max_unavailable", "max_surge and max_unavailable may "
                                                        "not both be 0: a rollout could "
                                                        "never start")
        values.update(checked(raw, LIST_FIELDS))
        values["model_source"] = model_source(raw, values)
        if allow_lists:
            check_allowed(values)
        return cls(**values)

    def as_dict(self) -> dict[str, object]:
        """The config as stored (tuples as lists)."""
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
    """A rollout step as a number (a percentage's number)."""
    return int(str(value).rstrip("%"))


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity (as QUANTITY matches it) as a number: cores or bytes."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or match.group(2) not in UNITS:
        raise BackendConfigError("quantity", f"{text!r} is not a quantity")
    return Decimal(match.group(1)) * UNITS[match.group(2)]


# --- each setting's check: the value as kept, or BackendConfigError -------------------

Check = Callable[[str, Any], Any]


def text(name: str, value: Any) -> str:
    """A string."""
    if not isinstance(value, str):
        raise BackendConfigError(name, "must be a string")
    return value


def flag(name: str, value: Any) -> bool:
    """true or false."""
    if not isinstance(value, bool):
        raise BackendConfigError(name, "must be true or false")
    return value


def one_of(choices: tuple[str, ...]) -> Check:
    """One of `choices`."""
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise BackendConfigError(name, f"one of {', '.join(choices)}")
        return value
    return check


def size(*, blank_ok: bool = False) -> Check:
    """A Kubernetes quantity above 0 (kept as a string); "" too where `blank_ok`."""
    def check(name: str, value: Any) -> str:
        if blank_ok and value == "":
            return ""
        if isinstance(value, bool) or not isinstance(value, str | int) or \
                not QUANTITY.match(str(value)) or not quantity(str(value)):
            raise BackendConfigError(name, "must be a Kubernetes quantity above 0 "
                                           "such as `8`, `500m` or `32Gi`")
        return str(value)
    return check


def whole(low: int, high: int) -> Check:
    """A whole number from `low` to `high`."""
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BackendConfigError(name, f"must be a whole number from {low} to {high}")
        return value
    return check


def secret_names(name: str, value: Any) -> tuple[str, ...]:
    """A list of Secret names."""
    if not isinstance(value, list) or not all(
            isinstance(s, str) and DNS_SUBDOMAIN.match(s) for s in value):
        raise BackendConfigError(name, "must be a list of Secret names")
    return tuple(value)


TOLERATION_FIELDS = frozenset(("key", "operator", "value", "effect", "tolerationSeconds"))
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def tolerations(name: str, value: Any) -> tuple[dict[str, Any], ...]:
    """A list of tolerations, each of a named taint: one without a key would tolerate every
    taint of every node (control-plane nodes, nodes kept for other teams)."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BackendConfigError(name, "must be a list of tolerations")
    for toleration in value:
        unknown = sorted(set(toleration) - TOLERATION_FIELDS)
        if unknown:
            raise BackendConfigError(name, f"unknown toleration field {unknown[0]!r}; known: "
                                           f"{', '.join(sorted(TOLERATION_FIELDS))}")
        key = toleration.get("key")
        if not isinstance(key, str) or not is_label_key(key):
            raise BackendConfigError(name, "each toleration names the taint's `key` (one "
                                           "without a key tolerates every taint)")
        operator = toleration.get("operator", "Equal")
        if operator not in ("Equal", "Exists") or (
                operator == "Exists" and toleration.get("value")):
            raise BackendConfigError(name, "`operator` is `Equal` (with a `value`) or "
                                           "`Exists` (without one)")
        if not isinstance(toleration.get("value", ""), str):
            raise BackendConfigError(name, "a toleration's `value` is a string")
        if toleration.get("effect", "") not in ("", *TOLERATION_EFFECTS):
            raise BackendConfigError(name, f"`effect` is one of "
                                           f"{', '.join(TOLERATION_EFFECTS)}")
        seconds = toleration.get("tolerationSeconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)
                                    or toleration.get("effect") != "NoExecute"):
            raise BackendConfigError(name, "`tolerationSeconds` is a whole number, with "
                                           "effect `NoExecute` only")
    return tuple(dict(t) for t in value)


def label_keys(name: str, value: Any) -> tuple[str, ...]:
    """A list of distinct label keys."""
    if not isinstance(value, list) or not all(
            isinstance(k, str) and is_label_key(k) for k in value) or \
            len(set(value)) != len(value):
        raise BackendConfigError(name, "must be a list of distinct node label keys such as "
                                       "`kubernetes.io/hostname`")
    return tuple(value)


def labels(name: str, value: Any) -> dict[str, str]:
    """Kubernetes labels: keys and values as Kubernetes accepts them."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BackendConfigError(name, "must map strings to strings")
    for key, label in value.items():
        if not is_label_key(key) or not LABEL_VALUE.match(label):
            raise BackendConfigError(name, f"{key}={label} is not a Kubernetes label")
    return dict(value)


TEXT_FIELDS: tuple[tuple[str, Check], ...] = tuple(
    (name, text) for name in ("kubeconfig", "context", "image", "image_tag",
                              "service_account", "gpu_product", "pvc_name", "host_path",
                              "hf_token_secret", "prometheus_address", "download_cache_pvc",
                              "priority_class_name"))
SETTING_FIELDS: tuple[tuple[str, Check], ...] = (
    *((name, flag) for name in ("in_cluster", "warm_up", "drain_on_sigterm",
                                "gateway_scraped", "pod_monitor")),
    ("scaling", one_of(SCALING)),
    ("topology_spread_when_unsatisfiable", one_of(WHEN_UNSATISFIABLE)),
    *((name, size(blank_ok=True)) for name in ("cpu", "memory", "shm_size")),
    *((name, size()) for name in ("cpu_per_gpu", "memory_per_gpu", "shm_per_gpu",
                                  "download_cache_size")),
    ("startup_seconds", whole(60, 86_400)),
    ("termination_grace_seconds", whole(10, 86_400)),
    ("gpus_per_node", whole(1, 64)),
    ("max_surge", rollout_step), ("max_unavailable", rollout_step),
)
LIST_FIELDS: tuple[tuple[str, Check], ...] = (
    ("image_pull_secrets", secret_names), ("tolerations", tolerations),
    ("topology_spread", label_keys), ("extra_labels", labels),
)


def checked(raw: dict[str, Any], fields: tuple[tuple[str, Check], ...]) -> dict[str, Any]:
    """The settings of `raw` that `fields` names, each checked, in the table's order."""
    return {name: check(name, raw[name]) for name, check in fields if name in raw}


def check_names(values: dict[str, Any]) -> None:
    """The image tag, the claims and the priority class are names Kubernetes accepts."""
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


def model_source(raw: dict[str, Any], values: dict[str, Any]) -> str:
    """Where pods find the model, with what that source needs."""
    source = raw.get("model_source", "download")
    if source not in MODEL_SOURCES:
        raise BackendConfigError("model_source", f"one of {', '.join(MODEL_SOURCES)}")
    if source == "pvc" and not values.get("pvc_name"):
        raise BackendConfigError("pvc_name", "required with model_source `pvc`: the "
                                             "PersistentVolumeClaim holding the models")
    if source == "hostPath" and not str(values.get("host_path", "")).startswith("/"):
        raise BackendConfigError("host_path", "required with model_source `hostPath`: "
                                              "an absolute path on the nodes")
    return str(source)


def check_allowed(values: dict[str, Any]) -> None:
    """What this install's settings allow (docs/security.md): the image, the node path a
    pod may mount, the service account, the priority class, a claim mounted read-write,
    the Prometheus KEDA queries; and a pinned image tag. An admin key configures
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
    for name, setting in (("priority_class_name", "KUBERNETES_ALLOWED_PRIORITY_CLASSES"),
                          ("download_cache_pvc", "KUBERNETES_ALLOWED_CACHE_CLAIMS"),
                          ("prometheus_address", "KUBERNETES_ALLOWED_PROMETHEUS_ADDRESSES")):
        value = str(values.get(name, getattr(KubernetesConfig, name)))
        if value and value not in getattr(settings, setting):
            raise BackendConfigError(name, f"{value!r} is not one this install allows "
                                           f"({setting})")
