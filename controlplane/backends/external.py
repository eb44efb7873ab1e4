"""The external backend: an OpenAI-compatible endpoint something else runs. It is observed
and routed to, never started or stopped."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from controlplane.backends import probe_client
from controlplane.backends.base import BackendConfigError, Observation
from controlplane.backends.probe_client import ProbeFailed

if TYPE_CHECKING:
    from controlplane.models import Deployment, Replica


def _visible_ascii(text: str) -> bool:
    return all("!" <= char <= "~" for char in text)


@dataclass(frozen=True)
class ExternalConfig:
    url: str
    api_key: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExternalConfig:
        unknown = sorted(set(data) - {"url", "api_key"})
        if unknown:
            raise BackendConfigError(unknown[0],
                                     f"unknown external backend setting {unknown[0]!r}")
        url = data.get("url")
        if not isinstance(url, str) or not url:
            raise BackendConfigError("url", "an external backend needs the endpoint's url")
        if not _visible_ascii(url):
            raise BackendConfigError("url", "must be ASCII with no spaces or control characters"
                                     " (write an international host name in its xn-- form)")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BackendConfigError("url", f"{url!r} is not an http(s) URL")
        api_key = data.get("api_key", "")
        if not isinstance(api_key, str):
            raise BackendConfigError("api_key", "must be a string")
        if api_key and not _visible_ascii(api_key):
            # It is sent as a header: a space, line break or non-ASCII letter cannot be.
            raise BackendConfigError("api_key", "must be visible ASCII characters only"
                                     " (no spaces, line breaks or other letters)")
        # The OpenAI base URL may be given with or without its /v1.
        return cls(url=url.rstrip("/").removesuffix("/v1"), api_key=api_key)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class ExternalBackend:
    creates_replicas = False
    owns_pods = False

    def __init__(self, config: ExternalConfig) -> None:
        # Probes go through the process's one probe client (controlplane/backends/
        # probe_client.py: one TLS context, connections kept per host).
        self.config = config

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def start(self, deployment: Deployment, replica: Replica) -> None:
        replica.endpoint = self.config.url

    def probe_target(self) -> tuple[str, str, str]:
        """What a probe asks (controlplane/reconciler/probes.py:probe_key): every
        deployment on this URL with this key gets the same answer."""
        return ("external", self.config.url, self.config.api_key)

    def observe(self, deployment: Deployment, replica: Replica, *,
                probe_health: bool = True) -> Observation:
        if not probe_health:
            return Observation(alive=True, healthy=True, message="not probed", probed=False)
        try:
            status = probe_client.shared().status(
                self.config.url, "/v1/models", tuple(self._headers().items()), timeout=5.0)
        except ProbeFailed as exc:
            return Observation(alive=False, healthy=False,
                               message=f"{self.config.url} unreachable ({str(exc)[:300]})")
        healthy = status == 200
        return Observation(alive=healthy, healthy=healthy, message="" if healthy else (
            f"{self.config.url} unreachable (/v1/models answered {status})"))

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        return None

    def in_flight(self, replica: Replica) -> int | None:
        return None

    def stop(self, replica: Replica, *, force: bool) -> None:
        return None

    def is_gone(self, replica: Replica) -> bool:
        return True

    def logs(self, replica: Replica, lines: int) -> list[str]:
        return []

    def cleanup_orphans(self, known: set[str]) -> list[str]:
        return []
