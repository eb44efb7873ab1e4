"""Drift: what differs between an object the Kubernetes backend renders and the object the
API server holds, and who changed it.

The comparison is a subset one: every field the backend renders must be in the live
object with the same value (lists element by element, same length), while fields the
server or other controllers add (defaults, status, managedFields) are ignored.
Quantities compare by value (`1.5` and `1500m` are the same CPU).

Who changed a field comes from `metadata.managedFields`, where the server reports it: the
manager whose field set holds the changed field (`kubectl`, `kubectl-edit`, ...).

Pure functions of plain dicts, tested without an API server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
# Keys whose values are Kubernetes quantities (the server may write them another way).
QUANTITY_PARENTS = {"requests", "limits"}
QUANTITY_KEYS = {"sizeLimit", "averageValue"}
SHOWN_DIFFERENCES = 5


@dataclass(frozen=True)
class Difference:
    """One rendered field the live object does not hold as rendered."""

    path: str  # as a person reads it: spec.template.spec.containers[vllm].image
    # The path as managedFields spell it: ("f", key) for a map key, ("e", element) for a
    # list element (matched against the `k:{...}` keys of a field set).
    fields: tuple[tuple[str, Any], ...]
    live: Any
    wanted: Any


def differences(wanted: Any, live: Any) -> list[Difference]:
    """Every field of `wanted` that `live` lacks or holds with another value."""
    found: list[Difference] = []
    _compare(wanted, live, "", (), found)
    return found


def _compare(wanted: Any, live: Any, path: str, fields: tuple[tuple[str, Any], ...],
             found: list[Difference]) -> None:
    if isinstance(wanted, dict):
        if not isinstance(live, dict):
            found.append(Difference(path, fields, live, wanted))
            return
        for key, value in wanted.items():
            _compare(value, live.get(key, MISSING), f"{path}.{key}" if path else key,
                     (*fields, ("f", key)), found)
        return
    if isinstance(wanted, list):
        if not isinstance(live, list) or len(live) != len(wanted):
            found.append(Difference(path, fields, live, wanted))
            return
        for index, (item, held) in enumerate(zip(wanted, live, strict=True)):
            label = item.get("name") if isinstance(item, dict) else None
            _compare(item, held, f"{path}[{label if label else index}]",
                     (*fields, ("e", item)), found)
        return
    if wanted == live or _same_quantity(fields, wanted, live):
        return
    if live is MISSING and _zero(wanted):
        return  # the API server leaves zero values of plain fields out of what it returns
    found.append(Difference(path, fields, live, wanted))


def _zero(value: Any) -> bool:
    """A zero value Kubernetes omits when it serialises a non-pointer field (`false`, 0,
    an empty string, list or map): absent in the live object is the same value."""
    return value is False or value == 0 or value in ("", [], {})


def _same_quantity(fields: tuple[tuple[str, Any], ...], wanted: Any, live: Any) -> bool:
    if not fields or not isinstance(live, str | int | float) or isinstance(live, bool):
        return False
    key = fields[-1][1] if fields[-1][0] == "f" else ""
    parent = fields[-2][1] if len(fields) > 1 and fields[-2][0] == "f" else ""
    if key not in QUANTITY_KEYS and parent not in QUANTITY_PARENTS:
        return False
    from kubernetes.utils import parse_quantity

    try:
        return bool(parse_quantity(wanted) == parse_quantity(live))
    except (ValueError, TypeError):
        return False


def owners(live: dict[str, Any], difference: Difference) -> list[str]:
    """The managers that own the field's live value, per the object's managedFields."""
    found = []
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, dict):
            continue
        if _owns(entry.get("fieldsV1") or {}, difference.fields):
            manager = str(entry.get("manager") or "?")
            if manager not in found:
                found.append(manager)
    return found


def _owns(node: Any, fields: tuple[tuple[str, Any], ...]) -> bool:
    for kind, value in fields:
        if not isinstance(node, dict):
            return False
        if not node or set(node) == {"."}:
            return True  # the manager owns this value whole (an atomic list, say)
        if kind == "f":
            key = f"f:{value}"
            if key not in node:
                return False
            node = node[key]
            continue
        match = next((child for key, child in node.items()
                      if key.startswith("k:") and _keyed(key, value)), None)
        if match is None:
            return False
        node = match
    return True


def _keyed(key: str, element: Any) -> bool:
    try:
        wanted = json.loads(key[2:])
    except ValueError:
        return False
    return isinstance(wanted, dict) and isinstance(element, dict) and all(
        element.get(name) == value for name, value in wanted.items())


def describe(kind: str, name: str, found: list[Difference], live: dict[str, Any], *,
             ours: tuple[str, ...], main: bool) -> tuple[str, list[str]]:
    """A sentence for the deployment's events, and the other managers whose fields the
    next apply takes back. `main`: the object is the apps/v1 Deployment itself (named
    like the deployment, so its kind and name are left out). A Secret's values are
    never shown."""
    secret = kind == "Secret"
    parts: list[str] = []
    taken: list[str] = []
    for difference in found[:SHOWN_DIFFERENCES]:
        others = [m for m in owners(live, difference) if m not in ours]
        for manager in others:
            if manager not in taken:
                taken.append(manager)
        who = f" ({', '.join(others)})" if others else ""
        if secret:
            parts.append(f"{difference.path} changed{who} (value hidden), put back")
        else:
            parts.append(f"{difference.path} was {show(difference.live)}{who}, "
                         f"put back to {show(difference.wanted)}")
    if len(found) > SHOWN_DIFFERENCES:
        parts.append(f"and {len(found) - SHOWN_DIFFERENCES} more fields")
    where = "" if main else f"{kind} {name}: "
    text = f"drift: {where}" + "; ".join(parts)
    if taken:
        text += (f"; the field{'s' if len(found) > 1 else ''} taken back from "
                 f"{', '.join(taken)}")
    return text, taken


def show(value: Any) -> str:
    if value is MISSING:
        return "absent"
    text = json.dumps(value, sort_keys=True) if not isinstance(value, int | float) or \
        isinstance(value, bool) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."
