"""The protocol every backend speaks, and the one place a concrete backend is chosen.

The reconciler, the API and the pages reach backends only through this module. A backend
does the mechanics (start a server, look at it, warm it up, stop it, read its logs); the
reconciler owns the phases and the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from controlplane.models import Backend, Deployment, Replica


class BackendError(Exception):
    """A backend could not do what was asked; the message is shown to the operator."""


class BackendConfigError(ValueError):
    """A backend's configuration is invalid; `field` names the key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Observation:
    """What a backend sees of one replica."""

    alive: bool  # the process (or pod, or endpoint) exists
    healthy: bool  # it answers its health check
    message: str = ""
    probed: bool = True  # False: nothing was asked (a probe not due), nothing is known


class ReplicaBackend(Protocol):
    """Backends that start and stop each replica themselves (local, external)."""

    #: False for backends that only observe endpoints something else runs.
    creates_replicas: bool
    #: False here; True for a PodSetBackend.
    owns_pods: bool

    def start(self, deployment: Deployment, replica: Replica) -> None:
        """Launch the replica; fill in its pid/pod, port, endpoint and log path."""

    def observe(self, deployment: Deployment, replica: Replica, *,
                probe_health: bool = True) -> Observation:
        """Is it there, and (when probe_health) does it answer its health check? Without
        the probe only the cheap checks run, and healthy repeats the last known answer."""

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        """Send one real request so no user pays the first-request cost; raises on failure."""

    def in_flight(self, replica: Replica) -> int | None:
        """Requests the replica is serving or queueing, or None when unknown."""

    def stop(self, replica: Replica, *, force: bool) -> None:
        """Ask the replica to stop (SIGTERM), or make it stop (SIGKILL)."""

    def is_gone(self, replica: Replica) -> bool:
        """True once nothing of the replica is left running."""

    def logs(self, replica: Replica, lines: int) -> list[str]:
        """The last lines of the replica's log."""

    def cleanup_orphans(self, known: set[str]) -> list[str]:
        """Stop servers this backend started that no replica record knows; their names."""


@dataclass(frozen=True)
class Member:
    """One server of a set a PodSetBackend keeps (a pod), as the backend sees it."""

    name: str
    phase: str  # a Replica.Phase value
    endpoint: str
    node: str
    devices: str
    role: str  # Replica.Role value
    generation: int  # the deployment generation it runs
    restarts: int
    message: str  # why it is not serving, in words a person can act on; "" when fine
    deleting: bool
    removal_marked: bool  # chosen to go first at the next scale-down


class PodSetBackend(Protocol):
    """Backends whose platform keeps the servers running (Kubernetes): the control plane
    asks for a count and a spec, then maps what it observes to replica records. The
    reconciler still owns the decisions: which members take traffic (role), which go first
    on a scale-down, when a deployment's objects are removed."""

    creates_replicas: bool
    owns_pods: bool  # True

    def refresh(self) -> None:
        """Once per reconcile pass: read what is applied and the members; raises
        BackendError when the platform cannot be read (nothing is then concluded)."""

    def members(self, deployment: Deployment) -> list[Member]:
        """The deployment's servers as of the last refresh."""

    def apply(self, deployment: Deployment, replicas: int | None = None) -> bool:
        """Make the platform hold the deployment's spec and count (desired active plus
        standby, or `replicas` while members chosen to go still drain); put back what
        others changed in it; True when it had to write. Raises BackendError with the
        platform's message."""

    def problems(self, deployment: Deployment) -> list[str]:
        """Why members are missing or failing, in the platform's words, as of the last
        refresh (each distinct message once)."""

    def notices(self, deployment: Deployment) -> list[tuple[str, str]]:
        """(action, message) of what the last apply did that a person should hear about
        (drift put back, a handover to an autoscaler); each is given once."""

    def scales_itself(self) -> bool:
        """True when the platform sets the count (a native autoscaler)."""

    def set_role(self, deployment: Deployment, replica: Replica, role: str) -> None:
        """Label a member active (takes traffic) or standby; no restart."""

    def mark_for_removal(self, replica: Replica, marked: bool = True) -> None:
        """Make this member among the first to go when the count is next lowered (or,
        with marked=False, no longer)."""

    def remove(self, deployment: Deployment) -> bool:
        """Delete everything made for the deployment; True once nothing is left."""

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        """Send one real request before the member takes traffic; raises on failure."""

    def in_flight(self, replica: Replica) -> int | None:
        """Requests the member is serving or queueing, or None when unknown."""

    def logs(self, replica: Replica, lines: int) -> list[str]:
        """The last lines of the member's log."""


def validate_backend_config(kind: str, config: dict[str, object]) -> dict[str, object]:
    """Check a backend's configuration; returns it normalised or raises BackendConfigError."""
    if kind == "local":
        from controlplane.backends.local import LocalConfig

        return LocalConfig.from_dict(config).as_dict()
    if kind == "external":
        from controlplane.backends.external import ExternalConfig

        return ExternalConfig.from_dict(config).as_dict()
    if kind == "kubernetes":
        from controlplane.backends.k8s_manifests import KubernetesConfig

        return KubernetesConfig.from_dict(config).as_dict()
    raise BackendConfigError("kind", f"unknown backend kind {kind!r}")


AnyBackend = ReplicaBackend | PodSetBackend
_instances: dict[tuple[int, str], AnyBackend] = {}


def backend_for(record: Backend) -> AnyBackend:
    """The backend object for a Backend record, kept for the life of the process (the local
    backend holds its child processes)."""
    import json

    key = (record.pk, json.dumps(record.config, sort_keys=True))
    backend = _instances.get(key)
    if backend is None:
        if record.kind == "local":
            from controlplane.backends.local import LocalBackend, LocalConfig

            # Allow-lists are checked when the backend acts (start, apply), so a config
            # stored before them, or a setting narrowed since, fails its own deployments
            # with a message instead of every reconcile pass.
            backend = LocalBackend(LocalConfig.from_dict(record.config, allow_lists=False))
        elif record.kind == "external":
            from controlplane.backends.external import ExternalBackend, ExternalConfig

            backend = ExternalBackend(ExternalConfig.from_dict(record.config))
        elif record.kind == "kubernetes":
            from controlplane.backends.k8s_manifests import KubernetesConfig
            from controlplane.backends.kubernetes import KubernetesBackend

            backend = KubernetesBackend(KubernetesConfig.from_dict(record.config,
                                                                   allow_lists=False))
        else:
            raise BackendError(f"backend kind {record.kind!r} is not available")
        for old in [k for k in _instances if k[0] == record.pk]:  # its config changed
            close = getattr(_instances.pop(old), "close", None)
            if close is not None:
                close()
        _instances[key] = backend
    return backend


def close_backends() -> None:
    """Let go of every backend object (their pools, watches); the next use makes new ones."""
    for backend in _instances.values():
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    _instances.clear()
