"""The oldest Kubernetes the control plane supports, and the check of a cluster against it.

1.30: the pods' `lifecycle.preStop.sleep` action (the gateway's and each vLLM pod's pause
before SIGTERM, while the Service stops sending them requests) is on by default from
Kubernetes 1.30 (feature gate PodLifecycleSleepAction, beta there, GA in 1.34). An older
API server refuses or silently drops it, and streams would be cut at every rollout.
"""

from __future__ import annotations

import re
from typing import Any

from controlplane.backends.base import BackendError

MINIMUM_VERSION = (1, 30)
_DIGITS = re.compile(r"^(\d+)")
_GIT_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


class UnsupportedKubernetesVersion(BackendError):
    """The cluster's API server is older than MINIMUM_VERSION, or says no version."""


def server_version(version_info: dict[str, Any]) -> tuple[int, int]:
    """(major, minor) from what the API server's /version answers: `major` and `minor`
    (providers add a `+`: "30+"), else `gitVersion` ("v1.30.2-eks-1234")."""
    major = _DIGITS.match(str(version_info.get("major") or ""))
    minor = _DIGITS.match(str(version_info.get("minor") or ""))
    if major and minor:
        return int(major.group(1)), int(minor.group(1))
    git = version_info.get("gitVersion") or version_info.get("git_version") or ""
    found = _GIT_VERSION.match(str(git))
    if found:
        return int(found.group(1)), int(found.group(2))
    raise UnsupportedKubernetesVersion(
        f"the Kubernetes API server did not say its version (/version answered "
        f"{dict(version_info)!r}); Fleetplane needs Kubernetes "
        f"{MINIMUM_VERSION[0]}.{MINIMUM_VERSION[1]} or later")


def check_server_version(version_info: dict[str, Any]) -> None:
    """Raise UnsupportedKubernetesVersion, naming both versions, for a cluster older than
    MINIMUM_VERSION. `version_info` is /version's answer (the official client's
    `VersionApi().get_code().to_dict()` spells `git_version`; both spellings are read)."""
    found = server_version(version_info)
    if found < MINIMUM_VERSION:
        raise UnsupportedKubernetesVersion(
            f"the cluster runs Kubernetes {found[0]}.{found[1]}; Fleetplane needs Kubernetes "
            f"{MINIMUM_VERSION[0]}.{MINIMUM_VERSION[1]} or later (its pods use the preStop "
            f"sleep action, on by default from 1.30): upgrade the cluster")
