"""Pods, as the Kubernetes API returns them, mapped to replica phases and messages."""

from __future__ import annotations

from typing import Any

from controlplane.backends.k8s_pods import observe_pod


def pod(phase: str = "Pending", *, conditions: list[dict[str, Any]] | None = None,
        container: dict[str, Any] | None = None, ip: str = "", node: str = "",
        deleting: bool = False, role: str = "active") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "chat-7d9c-abcde",
                                "labels": {"fleetplane.io/role": role}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if ip:
        status["podIP"] = ip
    if container is not None:
        status["containerStatuses"] = [{"name": "vllm", "image": "vllm/vllm-openai:latest",
                                        "imageID": "", "restartCount": 0, "ready": False,
                                        **container}]
    return {"metadata": metadata, "status": status, "spec": {
        "nodeName": node, "containers": [{"name": "vllm", "resources": {
            "limits": {"nvidia.com/gpu": "2"}}}]}}


def test_a_ready_pod_is_a_ready_replica_with_its_endpoint_node_and_gpus() -> None:
    state = observe_pod(pod("Running", ip="10.1.2.3", node="gpu-node-4", conditions=[
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
        container={"ready": True, "started": True, "state": {"running": {}}}))
    assert (state.phase, state.endpoint, state.node, state.devices, state.message) == (
        "ready", "http://10.1.2.3:8000", "gpu-node-4", "2 GPU", "")
    assert state.name == "chat-7d9c-abcde" and state.role == "active"


def test_a_pod_no_node_can_take_shows_the_schedulers_words() -> None:
    state = observe_pod(pod(conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]))
    assert state.phase == "pending"
    assert state.message == ("not scheduled (Unschedulable): 0/3 nodes are available: "
                             "3 Insufficient nvidia.com/gpu.")


def test_an_image_that_cannot_be_pulled_is_a_failed_replica() -> None:
    state = observe_pod(pod(conditions=[{"type": "PodScheduled", "status": "True"}],
                            container={"state": {"waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "vllm/vllm-openai:nope"'}}}))
    assert state.phase == "failed"
    assert state.message.startswith("the image cannot be pulled (ImagePullBackOff)")
    assert "vllm/vllm-openai:nope" in state.message


def test_a_crash_loop_after_out_of_memory_says_so() -> None:
    state = observe_pod(pod("Running", ip="10.1.2.3", conditions=[
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
        container={"restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                   "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}))
    assert state.phase == "failed" and state.restarts == 4
    assert "out of memory (OOMKilled)" in state.message and "CrashLoopBackOff" in state.message
    plain = observe_pod(pod("Running", container={"state": {"waiting": {
        "reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {"reason": "Error"}}}))
    assert plain.message == "the server keeps crashing (CrashLoopBackOff)"


def test_one_out_of_memory_restart_is_still_starting() -> None:
    state = observe_pod(pod("Running", ip="10.1.2.3", conditions=[
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
        container={"restartCount": 1, "state": {"running": {}},
                   "lastState": {"terminated": {"reason": "OOMKilled"}}}))
    assert state.phase == "starting" and "OOMKilled" in state.message


def test_a_running_pod_not_yet_ready_is_loading_its_model() -> None:
    state = observe_pod(pod("Running", ip="10.1.2.3", conditions=[
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
        container={"started": True, "state": {"running": {}}}))
    assert state.phase == "loading"
    creating = observe_pod(pod(conditions=[{"type": "PodScheduled", "status": "True"}],
                               container={"state": {"waiting": {
                                   "reason": "ContainerCreating"}}}))
    assert creating.phase == "starting"
    assert creating.message == "creating the container (ContainerCreating)"


def test_a_pod_being_deleted_is_draining_and_an_ended_one_failed() -> None:
    assert observe_pod(pod("Running", deleting=True)).phase == "draining"
    ended = observe_pod(pod("Failed", container={"state": {"terminated": {
        "reason": "Error", "exitCode": 1}}}))
    assert ended.phase == "failed" and ended.message == "the pod ended (Failed) (Error)"
    assert observe_pod(pod(role="standby")).role == "standby"
