"""Why a deployment's pods are missing or failing, in the API server's own words: the
apps/v1 Deployment's status conditions (ReplicaFailure, ProgressDeadlineExceeded), its
ReplicaSets' conditions (FailedCreate: an exceeded quota, a Pod Security violation), and
the warning events of its ReplicaSets and pods (FailedScheduling, FailedMount, image
pulls, back-offs, OOM kills).

Pure functions of the objects as the API returns them (dicts), so they are tested
without an API server. Each distinct message appears once: events repeated for several
pods are coalesced, and a message already said by a condition is not said again.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

# Warning events worth a person's attention; the rest (a readiness probe failing while a
# model loads, say) are the normal course of a start.
REASONS = frozenset({
    "FailedCreate", "FailedScheduling", "FailedAttachVolume", "FailedMount", "Failed",
    "ErrImagePull", "ImagePullBackOff", "InspectFailed", "ErrImageNeverPull", "BackOff",
    "OOMKilling", "Evicted", "FailedCreatePodSandBox", "FailedPreStopHook",
    "FailedKillPod", "Preempted", "FailedPostStartHook",
})
# Older events describe troubles that may be over.
EVENT_WINDOW = timedelta(minutes=10)
NAMES_SHOWN = 3


def troubles(deployment: dict[str, Any] | None, replica_sets: list[dict[str, Any]],
             events: list[dict[str, Any]], waiting_pods: set[str],
             now: datetime | None = None) -> list[str]:
    """The deployment's troubles as sentences. `waiting_pods`: its pods that exist and are
    not ready (events about the others are old news)."""
    found: list[str] = []

    def add(text: str, message: str) -> None:
        if message and not any(message in said or said in message for said in found):
            found.append(text)

    if deployment:
        name = (deployment.get("metadata") or {}).get("name", "")
        for item in (deployment.get("status") or {}).get("conditions") or []:
            if _failing(item):
                add(f"Deployment {name}: {item.get('reason') or item.get('type')}: "
                    f"{item.get('message') or ''}".rstrip(": "), str(item.get("message")))
    short: set[str] = set()
    for replica_set in replica_sets:
        metadata = replica_set.get("metadata") or {}
        wanted = int((replica_set.get("spec") or {}).get("replicas") or 0)
        status = replica_set.get("status") or {}
        if not wanted or int(status.get("readyReplicas") or 0) >= wanted:
            continue
        name = str(metadata.get("name") or "")
        short.add(name)
        for item in status.get("conditions") or []:
            if item.get("type") == "ReplicaFailure" and item.get("status") == "True":
                add(f"ReplicaSet {name}: {item.get('reason') or 'ReplicaFailure'}: "
                    f"{item.get('message') or ''}", str(item.get("message") or ""))
    now = now or datetime.now(UTC)
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for event in sorted(events, key=lambda e: _when(e) or datetime.min.replace(tzinfo=UTC)):
        involved = event.get("involvedObject") or event.get("regarding") or {}
        kind, name = str(involved.get("kind") or ""), str(involved.get("name") or "")
        reason = str(event.get("reason") or "")
        if reason not in REASONS or event.get("type", "Warning") != "Warning":
            continue
        if not ((kind == "Pod" and name in waiting_pods)
                or (kind == "ReplicaSet" and name in short)):
            continue
        when = _when(event)
        if when is not None and now - when > EVENT_WINDOW:
            continue
        message = str(event.get("message") or event.get("note") or "").strip()
        names = grouped.setdefault((kind, reason, message), [])
        if name not in names:
            names.append(name)
    for (kind, reason, message), names in grouped.items():
        shown = ", ".join(names[:NAMES_SHOWN]) + (
            f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")
        add(f"{kind} {shown}: {reason}: {message}", message.removeprefix("Error creating: "))
    return found


def _failing(condition: dict[str, Any]) -> bool:
    kind, status = condition.get("type"), condition.get("status")
    if kind == "ReplicaFailure":
        return status == "True"
    return kind == "Progressing" and status == "False" and condition.get(
        "reason") == "ProgressDeadlineExceeded"


def _when(event: dict[str, Any]) -> datetime | None:
    series = event.get("series") or {}
    for value in (series.get("lastObservedTime"), event.get("lastTimestamp"),
                  event.get("eventTime"), (event.get("metadata") or {}).get(
                      "creationTimestamp")):
        if value:
            try:
                when = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            except ValueError:
                continue
            return when if when.tzinfo else when.replace(tzinfo=UTC)
    return None
