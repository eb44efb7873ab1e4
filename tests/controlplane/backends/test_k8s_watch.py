"""The Kubernetes backend's pod watch against the STAND-IN API server (kmock): it lists,
then follows changes; a 410 Gone makes it list again; an unreachable server is retried
with growing delays and reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import kmock
import pytest

from controlplane.backends.k8s_client import Cluster, api_client
from controlplane.backends.k8s_manifests import KubernetesConfig
from controlplane.backends.k8s_watch import PodWatcher
from tests.k8s_emulator import EmulatedCluster
from tests.processes import free_port

CONFIG = KubernetesConfig.from_dict({"namespace": "inference"})
MANAGED = {"app.kubernetes.io/managed-by": "fleetplane", "fleetplane.io/install": "fleetplane"}


@pytest.fixture
def watchers() -> Iterator[Callable[..., PodWatcher]]:
    started: list[PodWatcher] = []

    def start(cluster: Cluster, on_change: Callable[[], None] = lambda: None) -> PodWatcher:
        watcher = PodWatcher(cluster, on_change)  # told before its thread lists
        started.append(watcher)
        return watcher.start()

    yield start
    for watcher in started:
        watcher.stop()


def wait_for(check: Callable[[], Any], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.02)


def create_pod(cluster: Cluster, name: str, labels: dict[str, str]) -> None:
    from kubernetes import client

    pod = client.V1Pod.from_dict({"metadata": {
        "name": name, "namespace": "inference", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}})
    assert pod is not None
    client.CoreV1Api(cluster.client).create_namespaced_pod("inference", pod)


def names(watcher: PodWatcher) -> list[str]:
    return sorted(p["metadata"]["name"] for p in watcher.snapshot())


def test_the_watch_lists_then_follows_changes(
        emulated: EmulatedCluster, watchers: Callable[..., PodWatcher]) -> None:
    from kubernetes import client

    cluster = Cluster(CONFIG, api_client(CONFIG, emulated.url))
    create_pod(cluster, "before", MANAGED)
    changes: list[int] = []
    watcher = watchers(cluster, lambda: changes.append(1))  # the first list counts too
    wait_for(lambda: watcher.watching, "a watch open")
    assert names(watcher) == ["before"] and watcher.lists == 1
    create_pod(cluster, "after", MANAGED)
    create_pod(cluster, "stranger", {"app": "other"})  # not managed: never kept
    wait_for(lambda: names(watcher) == ["after", "before"], "the new pod seen")
    client.CoreV1Api(cluster.client).patch_namespaced_pod_status(
        "after", "inference", {"status": {"podIP": "10.1.0.9"}},
        _content_type="application/merge-patch+json")
    wait_for(lambda: any(p["status"].get("podIP") == "10.1.0.9" for p in watcher.snapshot()
                         if p.get("status")), "the change seen")
    client.CoreV1Api(cluster.client).delete_namespaced_pod("before", "inference")
    wait_for(lambda: names(watcher) == ["after"], "the deletion seen")
    assert watcher.lists == 1 and len(changes) >= 4  # followed, not listed again


GONE = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
        "reason": "Expired", "message": "too old resource version: 1 (2)"}


@pytest.mark.parametrize("form", ["answer", "event"])
def test_gone_makes_it_list_again(emulated: EmulatedCluster,
                                  watchers: Callable[[Cluster], PodWatcher],
                                  form: str) -> None:
    def expire_first_watch() -> None:
        assert emulated.emulator is not None
        first = emulated.emulator["watch", kmock.resource("v1/pods")][:1]
        if form == "answer":  # the watch request itself answered 410
            first << 410 << GONE
        else:  # an open watch streams an ERROR event with code 410, as API servers do
            first << ({"type": "ERROR", "object": GONE},)

    emulated.call(expire_first_watch)
    cluster = Cluster(CONFIG, api_client(CONFIG, emulated.url))
    watcher = watchers(cluster)
    # The first watch may still count as open when this looks: wait for the second list.
    wait_for(lambda: watcher.lists == 2 and watcher.watching, "a watch open after the 410")
    assert watcher.failures == 0 and watcher.error is None
    create_pod(cluster, "later", MANAGED)
    wait_for(lambda: names(watcher) == ["later"], "events after the new list")


def test_an_unreachable_server_is_retried_with_growing_delays(
        watchers: Callable[[Cluster], PodWatcher]) -> None:
    cluster = Cluster(CONFIG, api_client(CONFIG, f"http://127.0.0.1:{free_port()}"))
    watcher = watchers(cluster)
    wait_for(lambda: watcher.failures >= 2, "two failed attempts")
    assert not watcher.synced and not watcher.watching
    assert watcher.error is not None and watcher.error.status == 0
    assert "cannot be reached" in str(watcher.error)
    assert "Connection refused" in str(watcher.error)
    assert watcher.delay >= 2  # 1 s after the first failure, then 2 s, 4 s ... 30 s
