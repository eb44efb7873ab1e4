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


class ReplicaBackend(Protocol):
    #: False for backends that only observe endpoints something else runs.
    creates_replicas: bool

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


def validate_backend_config(kind: str, config: dict[str, object]) -> dict[str, object]:
    """Check a backend's configuration; returns it normalised or raises BackendConfigError."""
    if kind == "local":
        from controlplane.backends.local import LocalConfig

        return LocalConfig.from_dict(config).as_dict()
    if kind == "external":
        from controlplane.backends.external import ExternalConfig

        return ExternalConfig.from_dict(config).as_dict()
    if kind == "kubernetes":
        raise BackendConfigError("kind", "the kubernetes backend is not available yet")
    raise BackendConfigError("kind", f"unknown backend kind {kind!r}")


_instances: dict[tuple[int, str], ReplicaBackend] = {}


def backend_for(record: Backend) -> ReplicaBackend:
    """The backend object for a Backend record, kept for the life of the process (the local
    backend holds its child processes)."""
    import json

    key = (record.pk, json.dumps(record.config, sort_keys=True))
    backend = _instances.get(key)
    if backend is None:
        if record.kind == "local":
            from controlplane.backends.local import LocalBackend, LocalConfig

            backend = LocalBackend(LocalConfig.from_dict(record.config))
        elif record.kind == "external":
            from controlplane.backends.external import ExternalBackend, ExternalConfig

            backend = ExternalBackend(ExternalConfig.from_dict(record.config))
        else:
            raise BackendError(f"backend kind {record.kind!r} is not available")
        _instances[key] = backend
    return backend
