"""A STAND-IN Kubernetes API server for tests: the `kmock` emulator (no real API server
can run on these machines), on its own event loop in a thread so that the synchronous
`kubernetes` client can call it. kmock does not do server-side apply; the subclass below
makes an apply of a missing object create it (a later apply merges, as kmock's patch does),
which is enough for the backend's create-or-update calls. It ignores label selectors, so
the code under test filters by labels itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import kmock

PLAYER_AGENT = "cluster-player"  # the User-Agent of ClusterPlayer's requests
VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


class ApplyingEmulator(kmock.KubernetesEmulator):
    #: Requests served, by HTTP method (the benchmark checks a resync writes nothing).
    methods: dict[str, int]
    #: (API group, resource[/subresource], RBAC verb) of every request but the player's.
    verbs: set[tuple[str, str, str]]

    async def _handle(self, request: Any) -> Any:
        if self.__dict__.get("forget_requests"):
            # kmock keeps every request and scans them all to match each new one (O(n)
            # per request); a benchmark that injects nothing keeps only the current one.
            del self._requests[:-1]
        counts = self.__dict__.setdefault("methods", {})
        method = str(getattr(request.method, "name", request.method)).upper()
        counts[method] = counts.get(method, 0) + 1
        if request.resource is not None and request.headers.get(
                "User-Agent") != PLAYER_AGENT:
            verb = VERBS.get(method) or (
                "get" if request.name else
                "watch" if request.action == kmock.action.WATCH else "list")
            resource = request.resource.plural + (
                f"/{request.subresource}" if request.subresource else "")
            self.__dict__.setdefault("verbs", set()).add(
                (request.resource.group or "", resource, verb))
        content_type = request.headers.get("Content-Type", "")
        if (request.action == kmock.action.UPDATE and request.name
                and request.subresource is None
                and content_type.startswith("application/apply-patch")):
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                request.data.setdefault("metadata", {})["namespace"] = request.namespace
                object.__setattr__(request, "action", kmock.action.CREATE)
        return await super()._handle(request)


    # kmock finds the objects a request names by comparing every stored key through its
    # general pattern matcher: O(objects) per request, seconds per write at benchmark
    # sizes. The same answers, from the dict's own lookup and plain resource names.
    def _KubernetesEmulator__get_objs(self, request: Any, strict: bool) -> list[Any]:
        objects = self._objects._objects
        if request.name is not None and (strict or request.namespace is not None):
            found = objects.get((request.resource, request.namespace, request.name))
            return [found] if found is not None else []
        wanted = _resource_name(request.resource)
        return [obj for (resource, namespace, name), obj in objects.items()
                if _resource_name(resource) == wanted
                and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name)]


def _resource_name(resource: Any) -> tuple[str, str, str]:
    return (resource.group or "", resource.version or "", resource.plural or "")


class EmulatedCluster:
    """kmock serving on 127.0.0.1 from a background thread."""

    def __init__(self, *, forget_requests: bool = False) -> None:
        self.forget_requests = forget_requests
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        self.emulator: ApplyingEmulator | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.main(),), daemon=True)

    async def main(self) -> None:
        self.stopping = asyncio.Event()
        async with ApplyingEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            emulator.__dict__["forget_requests"] = self.forget_requests
            for resource in ("v1/pods", "v1/services", "v1/secrets", "apps/v1/deployments",
                             "policy/v1/poddisruptionbudgets",
                             "networking.k8s.io/v1/networkpolicies",
                             "autoscaling/v2/horizontalpodautoscalers",
                             "keda.sh/v1alpha1/scaledobjects"):  # as where KEDA is installed
                # Listed empty, not 404, before any object of the kind exists.
                emulator.resources[resource] = {}  # type: ignore[assignment]
            self.ready.set()
            await self.stopping.wait()

    def start(self) -> EmulatedCluster:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the emulated API server did not start")
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run on the emulator's loop (its objects and DSL are not thread-safe)."""
        async def run() -> Any:
            return function(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stored(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            assert self.emulator is not None
            try:
                stored = self.emulator.objects[resource, namespace, name]
            except KeyError:
                return None
            return None if stored.deleted else dict(stored)

        result: dict[str, Any] | None = self.call(read)
        return result


class ClusterPlayer:
    """Plays, through the API like the real components, what a cluster runs and the
    stand-in lacks: the Deployment/ReplicaSet controller (pods to match `spec.replicas`,
    the lowest pod-deletion cost removed first; pods of a removed Deployment collected),
    and the scheduler and kubelets (pod status: scheduled, ready, crashing, OOM-killed,
    unschedulable). Pods are named <deployment>-<serial>."""

    def __init__(self, url: str, namespace: str = "inference") -> None:
        from kubernetes import client

        self.client = client
        self.api = client.ApiClient(client.Configuration(host=url))
        self.api.user_agent = PLAYER_AGENT
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.namespace = namespace
        self.serial = 0

    def pods(self, deployment: str = "") -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(self.namespace).items or []
        pods = [self.api.sanitize_for_serialization(item) for item in items]
        return [p for p in pods if not deployment or (p["metadata"].get("labels") or {}).get(
            "app.kubernetes.io/instance") == deployment]

    def pod(self, name: str) -> dict[str, Any]:
        return next(p for p in self.pods() if p["metadata"]["name"] == name)

    def names(self, deployment: str = "") -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.pods(deployment)
                      if not p["metadata"].get("deletionTimestamp"))

    def sync(self, ready: bool = False) -> list[str]:
        """One pass of the ReplicaSet controller and the garbage collector; returns the
        pods it created (with `ready`, created running and ready at once, each with its
        own IP: one request per pod, for the benchmark)."""
        deployments = {str(self.api.sanitize_for_serialization(d)["metadata"]["name"]): d
                       for d in self.apps.list_namespaced_deployment(self.namespace).items
                       or []}
        created = []
        by_owner: dict[str, list[dict[str, Any]]] = {}
        for pod in self.pods():
            owner = (pod["metadata"].get("labels") or {}).get("app.kubernetes.io/instance", "")
            by_owner.setdefault(owner, []).append(pod)
        for name, deployment in deployments.items():
            live = [p for p in by_owner.get(name, [])
                    if not p["metadata"].get("deletionTimestamp")]
            spec = self.api.sanitize_for_serialization(deployment)["spec"]
            wanted, template = int(spec.get("replicas") or 0), spec["template"]
            for _ in range(wanted - len(live)):
                self.serial += 1
                pod_name = f"{name}-{self.serial}"
                raw = {"metadata": {"name": pod_name, "namespace": self.namespace,
                                    **template["metadata"]}, "spec": template["spec"]}
                if ready:
                    raw["spec"]["nodeName"] = "gpu-node-1"
                    raw["status"] = self.ready_status(
                        f"10.{self.serial // 65536}.{self.serial // 256 % 256}."
                        f"{self.serial % 256}")
                body = self.client.V1Pod.from_dict(raw)
                assert body is not None
                self.core.create_namespaced_pod(self.namespace, body)
                created.append(pod_name)

            def cost(pod: dict[str, Any]) -> int:
                notes = pod["metadata"].get("annotations") or {}
                return int(notes.get("controller.kubernetes.io/pod-deletion-cost", "0"))

            for victim in sorted(live, key=cost)[:max(0, len(live) - wanted)]:
                self.terminate(victim["metadata"]["name"])
        for owner, pods in by_owner.items():
            if owner not in deployments:
                for pod in pods:
                    self.delete(pod["metadata"]["name"])
        return created

    def terminate(self, name: str) -> None:
        """Graceful deletion begins (the pod runs its preStop hook)."""
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {
            "deletionTimestamp": "2026-01-01T00:00:00Z"}},
            _content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.namespace)

    def finish_terminating(self) -> None:
        for pod in self.pods():
            if pod["metadata"].get("deletionTimestamp"):
                self.delete(pod["metadata"]["name"])

    def _status(self, name: str, status: dict[str, Any], node: str = "gpu-node-1") -> None:
        self.core.patch_namespaced_pod(name, self.namespace, {"spec": {"nodeName": node}},
                                       _content_type="application/merge-patch+json")
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status},
                                              _content_type="application/merge-patch+json")

    def ready(self, name: str, ip: str = "10.1.0.1", restarts: int = 0) -> None:
        self._status(name, self.ready_status(ip, restarts))

    @staticmethod
    def ready_status(ip: str, restarts: int = 0) -> dict[str, Any]:
        return {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "vllm", "ready": True, "started": True,
                                   "restartCount": restarts, "image": "vllm", "imageID": "",
                                   "state": {"running": {}}}]}

    def loading(self, name: str, ip: str = "10.1.0.1") -> None:
        self._status(name, {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": "vllm", "ready": False, "started": True,
                                   "restartCount": 0, "image": "vllm", "imageID": "",
                                   "state": {"running": {}}}]})

    def unschedulable(self, name: str, message: str) -> None:
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
            "phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": message}]}}, _content_type="application/merge-patch+json")

    def waiting(self, name: str, reason: str, message: str = "", last: str = "") -> None:
        """The container cannot run: ImagePullBackOff, CrashLoopBackOff (after `last`,
        e.g. OOMKilled)."""
        container: dict[str, Any] = {
            "name": "vllm", "ready": False, "restartCount": 3 if last else 0,
            "image": "vllm", "imageID": "",
            "state": {"waiting": {"reason": reason, "message": message}}}
        if last:
            container["lastState"] = {"terminated": {"reason": last, "exitCode": 137}}
        self._status(name, {"phase": "Pending" if not last else "Running",
                            "conditions": [{"type": "PodScheduled", "status": "True"}],
                            "containerStatuses": [container]})


def write_kubeconfig(path: Any, url: str, namespace: str = "inference") -> str:
    """A kubeconfig whose only cluster is the stand-in API server."""
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulated",
        "clusters": [{"name": "emulated", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulated", "context": {
            "cluster": "emulated", "user": "tester", "namespace": namespace}}]}))
    return str(path)
