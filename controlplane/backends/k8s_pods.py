"""What a pod says about its replica: the Kubernetes backend maps each pod it watches to a
Replica row's phase, endpoint, node and devices, and to a message a person can act on
(ImagePullBackOff, CrashLoopBackOff, OOMKilled, Unschedulable with the scheduler's words).

A pure function of the pod object as the API returns it (a dict), giving a Member (how the
reconciler reads a pod-set backend's servers), so it is tested without an API server.
"""

from __future__ import annotations

from typing import Any

from controlplane.backends.base import Member
from controlplane.backends.k8s_manifests import GENERATION_ANNOTATION, PORT, ROLE_LABEL

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

# Container waiting reasons that will not resolve by waiting.
STUCK_REASONS = {
    "ImagePullBackOff": "the image cannot be pulled",
    "ErrImagePull": "the image cannot be pulled",
    "InvalidImageName": "the image name is invalid",
    "CreateContainerConfigError": "the container's configuration is invalid",
    "CreateContainerError": "the container cannot be created",
    "CrashLoopBackOff": "the server keeps crashing",
}


def observe_pod(pod: dict[str, Any]) -> Member:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = metadata.get("labels") or {}
    containers = status.get("containerStatuses") or []
    vllm = next((c for c in containers if c.get("name") == "vllm"),
                containers[0] if containers else {})
    restarts = int(vllm.get("restartCount") or 0)
    ip = status.get("podIP") or ""
    node = spec.get("nodeName") or ""
    gpus = ""
    for container in spec.get("containers") or []:
        if container.get("name") == "vllm":
            gpus = str(((container.get("resources") or {}).get("limits") or {}).get(
                "nvidia.com/gpu") or "")
    devices = f"{gpus} GPU" if gpus else ""
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    deleting = bool(metadata.get("deletionTimestamp"))
    annotations = metadata.get("annotations") or {}
    phase, message = _phase(status, conditions, vllm, deleting)
    return Member(
        name=str(metadata.get("name") or ""), phase=phase,
        endpoint=f"http://{ip}:{PORT}" if ip else "", node=node, devices=devices,
        role=str(labels.get(ROLE_LABEL) or "active"), restarts=restarts, message=message,
        deleting=deleting, generation=_integer(annotations.get(GENERATION_ANNOTATION)) or 0,
        removal_marked=(_integer(annotations.get(DELETION_COST)) or 0) < 0)


def _integer(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _phase(status: dict[str, Any], conditions: dict[str, dict[str, Any]],
           container: dict[str, Any], deleting: bool) -> tuple[str, str]:
    pod_phase = status.get("phase") or "Pending"
    state = container.get("state") or {}
    last = (container.get("lastState") or {}).get("terminated") or {}
    if deleting:
        return "draining", ""
    if pod_phase in ("Succeeded", "Failed"):
        reason = (state.get("terminated") or {}).get("reason") or status.get("reason") or ""
        return "failed", _join(f"the pod ended ({pod_phase})", reason,
                               status.get("message") or "")
    scheduled = conditions.get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return "pending", _join("not scheduled", scheduled.get("reason") or "",
                                scheduled.get("message") or "")
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason") or ""
    if reason in STUCK_REASONS:
        detail = STUCK_REASONS[reason]
        if reason == "CrashLoopBackOff" and last.get("reason") == "OOMKilled":
            detail = "the server keeps running out of memory (OOMKilled)"
        return "failed", _join(detail, reason, waiting.get("message") or "")
    if last.get("reason") == "OOMKilled" and not container.get("ready"):
        return "starting", "restarted after running out of memory (OOMKilled)"
    ready = conditions.get("Ready")
    if pod_phase == "Running" and ready and ready.get("status") == "True":
        return "ready", ""
    if pod_phase == "Running":
        started = container.get("started")
        return ("loading" if started else "starting"), ""
    if scheduled and scheduled.get("status") == "True":
        return "starting", _join("creating the container", reason, "") if reason else ""
    return "pending", ""


def _join(summary: str, reason: str, message: str) -> str:
    text = summary
    if reason:
        text += f" ({reason})"
    if message:
        text += f": {message}"
    return text
