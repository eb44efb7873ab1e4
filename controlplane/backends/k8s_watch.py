"""The pod watch of the Kubernetes backend: every pod this install manages in the
namespace, kept in memory by a thread: list, then watch from the list's resourceVersion,
re-list on 410 Gone, reconnect with exponential backoff."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from controlplane.backends.k8s_client import Cluster, ClusterError, Watch
from controlplane.backends.k8s_names import managed_labels

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

MANAGED = managed_labels()  # every object of this install, and only those
WATCH_SECONDS = 300
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class PodWatcher:
    """Keeps every pod this control plane manages in the namespace, in memory."""

    def __init__(self, cluster: Cluster, on_change: Callable[[], None]) -> None:
        self.cluster = cluster
        self.on_change = on_change
        self.lock = threading.Lock()
        self.pods: dict[str, dict[str, Any]] = {}
        self.synced = False  # a list succeeded and no error since
        self.watching = False  # a watch is open
        self.error: ClusterError | None = None
        self.lists = 0
        self.failures = 0
        self.delay = BACKOFF_FIRST
        self.stopping = threading.Event()
        self.open_watch: Watch | None = None
        self.thread = threading.Thread(target=self.run, daemon=True, name="pod-watch")

    def start(self) -> PodWatcher:
        """Start the watch thread."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the watch thread, closing the open watch."""
        self.stopping.set()
        if self.open_watch is not None:
            self.open_watch.close()

    def snapshot(self) -> list[dict[str, Any]]:
        """The pods as last seen."""
        with self.lock:
            return list(self.pods.values())

    def run(self) -> None:
        """The thread: list, follow the watch, list again on 410, back off on errors."""
        self.delay = BACKOFF_FIRST
        while not self.stopping.is_set():
            try:
                version = self.relist()
                while not self.stopping.is_set():
                    version = self.follow(version)
            except Gone:
                logger.info("pod watch expired (410 Gone): listing again")
            except Exception as exc:
                if self.stopping.is_set():
                    break
                if isinstance(exc, ClusterError) and exc.status == 410:
                    logger.info("pod watch expired (HTTP 410): listing again")
                    continue
                error = exc if isinstance(exc, ClusterError) else ClusterError(
                    0, f"watching pods: the connection failed ({exc.__class__.__name__})")
                self.error, self.synced, self.watching = error, False, False
                self.failures += 1
                logger.warning("pod watch failed (%s); again in %.0f s", error, self.delay)
                self.stopping.wait(self.delay)
                self.delay = min(self.delay * 2, BACKOFF_MAX)

    def relist(self) -> str:
        """List the pods afresh; the list's resourceVersion."""
        self.watching = False
        pods, version = self.cluster.list_pods(MANAGED)
        with self.lock:
            self.pods = {pod["metadata"]["name"]: pod for pod in pods}
        self.lists += 1
        self.synced, self.error = True, None
        self.on_change()
        return version

    def follow(self, version: str) -> str:
        """Apply the watch's events until it ends; the last resourceVersion seen."""
        self.open_watch = self.cluster.watch_pods(MANAGED, version, WATCH_SECONDS)
        self.watching, self.delay = True, BACKOFF_FIRST
        for event in self.open_watch:
            if self.stopping.is_set():
                break
            kind, obj = event.get("type"), event["object"]
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone
                raise ClusterError(int(obj.get("code") or 0),
                                   f"watching pods: {obj.get('message') or obj}")
            metadata = obj.get("metadata") or {}
            name = str(metadata.get("name") or "")
            version = str(metadata.get("resourceVersion") or version)
            labels = metadata.get("labels") or {}
            if kind == "BOOKMARK" or any(labels.get(k) != v for k, v in MANAGED.items()):
                continue
            with self.lock:
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:
                    self.pods[name] = obj
            self.on_change()
        return version
