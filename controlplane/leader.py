"""Leader election through a Kubernetes Lease (coordination.k8s.io/v1), so that of several
controller processes exactly one reconciles and collects at a time.

The holder renews the Lease every third of its duration. Another process takes it over
only once the holder has not renewed for the whole duration. Every write carries the
resourceVersion it read, so of two processes racing for an expired Lease the API server
lets one win (409 Conflict for the other). A holder that cannot renew within two thirds
of the duration stops its controllers (the process then exits and is restarted as a
follower); one that stops cleanly gives the Lease up so a follower takes over at once.

Renewal also needs progress: with a heartbeat (controlplane/liveness.py), a holder whose
last reconcile pass completed longer ago than the Lease's duration (a pass hung on a lock
or a socket) renews no more; it gives the Lease up and stops its controllers, so a
follower takes over instead of the Lease being held by a process that does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings

from controlplane import liveness
from controlplane.liveness import Heartbeat

logger = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def _micro_time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElection:
    def __init__(self, client: Any, namespace: str, name: str, identity: str,
                 duration_seconds: int = 15, progress: Heartbeat | None = None) -> None:
        from kubernetes import client as k8s

        self.api = k8s.CoordinationV1Api(client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration = duration_seconds
        self.leading = False
        #: Beaten by each completed reconcile pass; None: renew without looking.
        self.progress = progress

    @classmethod
    def from_settings(cls) -> LeaseElection | None:
        """The election the settings ask for, or None (LEADER_ELECTION=none)."""
        if settings.LEADER_ELECTION != "kubernetes":
            return None
        from kubernetes import client as k8s
        from kubernetes import config as loader

        configuration = k8s.Configuration()
        loader.load_incluster_config(client_configuration=configuration)
        namespace = settings.LEADER_ELECTION_NAMESPACE or _service_account_namespace()
        identity = settings.LEADER_ELECTION_IDENTITY or socket.gethostname()
        return cls(k8s.ApiClient(configuration), namespace, settings.LEADER_ELECTION_LEASE,
                   identity, settings.LEADER_ELECTION_LEASE_SECONDS, progress=liveness.heartbeat)

    def attempt(self) -> bool:
        """Acquire or renew the Lease once; True while this process holds it."""
        from kubernetes.client.exceptions import ApiException

        now = _now()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace,
                                                   _request_timeout=self.duration / 3)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create(now)
        spec = lease.spec
        holder = spec.holder_identity if spec else None
        renewed = spec.renew_time if spec else None
        duration = (spec.lease_duration_seconds if spec else None) or self.duration
        if holder and holder != self.identity and renewed and (
                renewed + timedelta(seconds=duration) > now):
            self.leading = False
            return False
        patch: dict[str, Any] = {"spec": {"holderIdentity": self.identity,
                                          "renewTime": _micro_time(now),
                                          "leaseDurationSeconds": self.duration}}
        if holder != self.identity:
            patch["spec"]["acquireTime"] = _micro_time(now)
            patch["spec"]["leaseTransitions"] = ((spec.lease_transitions or 0) if spec
                                                 else 0) + 1
        version = lease.metadata.resource_version if lease.metadata else None
        if version:  # the write only succeeds if nobody wrote since the read
            patch["metadata"] = {"resourceVersion": version}
        try:
            self.api.patch_namespaced_lease(self.name, self.namespace, patch,
                                            _content_type="application/merge-patch+json",
                                            _request_timeout=self.duration / 3)
        except ApiException as exc:
            if exc.status == 409:
                self.leading = False
                return False
            raise
        if not self.leading:
            logger.info("%s leads the controllers (Lease %s/%s)", self.identity,
                        self.namespace, self.name)
        self.leading = True
        return True

    def _create(self, now: datetime) -> bool:
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        body = k8s.V1Lease.from_dict({
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration,
                     "acquireTime": _micro_time(now), "renewTime": _micro_time(now),
                     "leaseTransitions": 0}})
        assert body is not None
        try:
            self.api.create_namespaced_lease(self.namespace, body,
                                             _request_timeout=self.duration / 3)
        except ApiException as exc:
            if exc.status == 409:  # another process created it first
                return False
            raise
        self.leading = True
        return True

    def release(self) -> None:
        """Give the Lease up (a clean stop): a follower need not wait for it to expire."""
        if not self.leading:
            return
        self.leading = False
        try:
            self.api.patch_namespaced_lease(
                self.name, self.namespace, {"spec": {"holderIdentity": "",
                                                     "leaseDurationSeconds": 1}},
                _content_type="application/merge-patch+json", _request_timeout=5)
        except Exception:  # the Lease then expires by itself
            logger.warning("could not give up the Lease %s/%s", self.namespace, self.name)

    def _attempt_safely(self) -> bool:
        try:
            return self.attempt()
        except Exception as exc:  # unreachable API server and the like: not leading
            logger.warning("leader election: %s", exc)
            return False

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this process leads (True), or until stop is set (False)."""
        while not stop.is_set():
            leading = await asyncio.to_thread(self._attempt_safely)
            if self.progress is not None:  # waiting is progress too, for the liveness check
                self.progress.beat("election attempt")
            if leading:
                return True
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.duration / 3)
            except TimeoutError:
                pass
        return False

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until stop is set. When renewal has failed for two thirds of the duration
        (before any other process may take over), or another holds it, or no reconcile
        pass or step of one has completed within the heartbeat's stall bound, set stop (and
        give the Lease up)."""
        last = asyncio.get_running_loop().time()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.duration / 3)
                break
            except TimeoutError:
                pass
            if self.progress is not None and self.progress.age() > self.progress.stall_seconds:
                logger.error("the controllers made no progress for %.0f s (the stall bound): "
                             "giving up the Lease %s/%s and stopping the controllers",
                             self.progress.age(), self.namespace, self.name)
                stop.set()
                break
            if await asyncio.to_thread(self._attempt_safely):
                last = asyncio.get_running_loop().time()
            elif (asyncio.get_running_loop().time() - last >= self.duration * 2 / 3
                  or not self.leading):
                logger.error("lost the Lease %s/%s: stopping the controllers",
                             self.namespace, self.name)
                stop.set()
        await asyncio.to_thread(self.release)


def _service_account_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return "default"
