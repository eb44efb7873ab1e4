"""What the STAND-IN Kubernetes API server (tests/k8s_emulator.py) checks the way the real
one does, as plain functions: label selectors, object names and label values, server-side
apply field ownership, and the RBAC authorizer over Roles and RoleBindings. Messages follow
the real API server's wording, so code that shows them to users is tested with real text."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# --- label selectors ------------------------------------------------------------------


class SelectorError(ValueError):
    """A labelSelector the API server cannot parse (it answers 400 BadRequest)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        present, value = self.key in labels, labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=", "notin"


_SET = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(notin|in)\s*\(([^()]*)\))?\s*$")
_EQUALITY = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


def parse_selector(text: str) -> list[Requirement]:
    """`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`, comma-separated."""
    terms, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:index])
            start = index + 1
    terms.append(text[start:])
    requirements = []
    for term in terms:
        if not term.strip():
            if text.strip():
                raise SelectorError(f"unable to parse requirement: empty term in {text!r}")
            continue
        if found := _EQUALITY.match(term):
            key, operator, value = found.groups()
            requirements.append(Requirement(key, "!=" if operator == "!=" else "=",
                                            frozenset([value])))
        elif found := _SET.match(term):
            negated, key, operator, values = found.groups()
            if negated and operator:
                raise SelectorError(f"unable to parse requirement: {term.strip()!r}")
            if operator:
                requirements.append(Requirement(key, operator, frozenset(
                    v.strip() for v in values.split(","))))
            else:
                requirements.append(Requirement(key, "!" if negated else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {term.strip()!r}")
    return requirements


def selected(requirements: list[Requirement], obj: dict[str, Any] | None) -> bool:
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in requirements)


# --- names and labels -----------------------------------------------------------------

DNS1035 = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
           "start with an alphabetic character, and end with an alphanumeric character "
           "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
           "'[a-z]([-a-z0-9]*[a-z0-9])?')")
DNS1123_SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                     "characters, '-' or '.', and must start and end with an alphanumeric "
                     "character (e.g. 'example.com', regex used for validation is "
                     "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, "
               "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
               "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
               "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
LABEL_NAME = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
              "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  "
              "or '123-abc', regex used for validation is "
              "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
#: Kinds whose names must be DNS-1035 labels (they become DNS names); others: subdomains.
DNS1035_NAMED = {"services"}


def name_errors(plural: str, name: str) -> list[tuple[str, str, str]]:
    """(field, value, detail) for a bad object name of this kind."""
    if plural in DNS1035_NAMED:
        limit, pattern, detail = 63, _DNS1035, DNS1035
    else:
        limit, pattern, detail = 253, _DNS1123_SUBDOMAIN, DNS1123_SUBDOMAIN
    errors = []
    if len(name) > limit:
        errors.append(("metadata.name", name, f"must be no more than {limit} characters"))
    if not pattern.match(name):
        errors.append(("metadata.name", name, detail))
    return errors


def label_errors(where: str, labels: Any) -> list[tuple[str, str, str]]:
    errors: list[tuple[str, str, str]] = []
    for key, value in (labels or {}).items():
        prefix, _, part = key.rpartition("/")
        if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
            errors.append((where, key, f"prefix part {DNS1123_SUBDOMAIN}"))
        if len(part) > 63 or not part or not _LABEL_VALUE.match(part):
            errors.append((where, key, LABEL_NAME))
        text = "" if value is None else str(value)
        if len(text) > 63:
            errors.append((where, text, "must be no more than 63 characters"))
        if not _LABEL_VALUE.match(text):
            errors.append((where, text, LABEL_VALUE))
    return errors


def object_errors(plural: str, obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The name and label checks the API server makes on create and update."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    errors = name_errors(plural, str(metadata.get("name") or ""))
    errors += label_errors("metadata.labels", metadata.get("labels"))
    template = (spec.get("template") or {}) if isinstance(spec, dict) else {}
    if isinstance(template, dict):
        errors += label_errors("spec.template.metadata.labels",
                               (template.get("metadata") or {}).get("labels"))
    selector = spec.get("selector") if isinstance(spec, dict) else None
    if isinstance(selector, dict):
        errors += label_errors("spec.selector.matchLabels", selector.get("matchLabels"))
    return errors


def go_selector(selector: Any) -> str:
    """A LabelSelector as the API server prints it in `field is immutable`."""
    labels = (selector or {}).get("matchLabels") or {}
    pairs = ", ".join(f'"{k}":"{v}"' for k, v in sorted(labels.items()))
    return (f"v1.LabelSelector{{MatchLabels:map[string]string{{{pairs}}}, "
            f"MatchExpressions:[]v1.LabelSelectorRequirement(nil)}}")


# --- server-side apply: field ownership -----------------------------------------------

#: Paths nobody owns: the server's own metadata, and status (owned through its subresource).
UNOWNED = {("apiVersion",), ("kind",), ("status",), ("metadata", "name"),
           ("metadata", "namespace"), ("metadata", "uid"), ("metadata", "resourceVersion"),
           ("metadata", "generation"), ("metadata", "creationTimestamp"),
           ("metadata", "managedFields"), ("metadata", "deletionTimestamp"),
           ("metadata", "selfLink")}
Path = tuple[str, ...]


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every field path of an object to its value: maps are walked, everything else
    (lists included, which the stand-in treats as atomic) is a leaf."""
    found: dict[Path, Any] = {}
    if not isinstance(obj, dict):
        return found
    for key, value in obj.items():
        path = (*prefix, str(key))
        if path in UNOWNED or path[:1] == ("status",):
            continue
        if isinstance(value, dict) and value:
            found.update(leaves(value, path))
        else:
            found[path] = value
    return found


def dotted(path: Path) -> str:
    return "".join(f".{part}" for part in path)


def fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return tree


def remove_path(obj: dict[str, Any], path: Path) -> None:
    node: Any = obj
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)


@dataclass
class Manager:
    """One entry of metadata.managedFields."""

    name: str
    operation: str  # Apply or Update
    api_version: str
    paths: set[Path] = field(default_factory=set)
    subresource: str = ""
    time: str = ""

    def entry(self) -> dict[str, Any]:
        entry = {"manager": self.name, "operation": self.operation,
                 "apiVersion": self.api_version, "time": self.time,
                 "fieldsType": "FieldsV1", "fieldsV1": fields_v1(self.paths)}
        if self.subresource:
            entry["subresource"] = self.subresource
        return entry


def conflict_message(conflicts: list[tuple[Manager, Path]]) -> str:
    """`Apply failed with 1 conflict: conflict with "kubectl" using apps/v1: .spec.replicas`"""
    count = len(conflicts)
    head = f"Apply failed with {count} conflict{'s' if count > 1 else ''}: "
    if count == 1:
        manager, path = conflicts[0]
        return f'{head}conflict with "{manager.name}" using {manager.api_version}: ' \
               f"{dotted(path)}"
    parts = []
    for manager in dict.fromkeys(m for m, _ in conflicts):
        paths = [dotted(p) for m, p in conflicts if m is manager]
        parts.append(f'conflicts with "{manager.name}" using {manager.api_version}:\n'
                     + "\n".join(f"- {p}" for p in paths))
    return head + "\n".join(parts)


# --- the RBAC authorizer --------------------------------------------------------------


@dataclass(frozen=True)
class Attributes:
    """What the API server's authorizer is asked about one request (one verb)."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def resource_path(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def service_account_groups(user: str) -> set[str]:
    groups = {"system:authenticated"}
    if user.startswith("system:serviceaccount:"):
        namespace = user.split(":")[2]
        groups |= {"system:serviceaccounts", f"system:serviceaccounts:{namespace}"}
    return groups


def rule_allows(rule: dict[str, Any], attributes: Attributes) -> bool:
    def has(values: Iterable[str] | None, wanted: str) -> bool:
        return any(v in ("*", wanted) for v in values or ())

    resources = rule.get("resources") or []
    resource_ok = any(r in ("*", attributes.resource_path) or (
        attributes.subresource and r == f"*/{attributes.subresource}") for r in resources)
    names = rule.get("resourceNames") or []
    return (has(rule.get("verbs"), attributes.verb)
            and has(rule.get("apiGroups"), attributes.group) and resource_ok
            and (not names or attributes.name in names))


class Rbac:
    """Roles, ClusterRoles and their bindings, read the way the RBAC authorizer reads them."""

    def __init__(self, documents: Iterable[dict[str, Any]]) -> None:
        self.roles: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.bindings: list[dict[str, Any]] = []
        for doc in documents:
            kind, metadata = doc.get("kind"), doc.get("metadata") or {}
            if kind in ("Role", "ClusterRole"):
                namespace = metadata.get("namespace", "") if kind == "Role" else ""
                self.roles[kind, f"{namespace}/{metadata['name']}"] = doc.get("rules") or []
            elif kind in ("RoleBinding", "ClusterRoleBinding"):
                self.bindings.append(doc)

    def bound(self, binding: dict[str, Any], user: str) -> bool:
        groups = service_account_groups(user)
        for subject in binding.get("subjects") or []:
            kind, name = subject.get("kind"), subject.get("name")
            if kind == "ServiceAccount" and user == (
                    f"system:serviceaccount:{subject.get('namespace')}:{name}"):
                return True
            if (kind == "User" and name == user) or (kind == "Group" and name in groups):
                return True
        return False

    def rules(self, user: str, namespace: str) -> Iterator[dict[str, Any]]:
        """The rules that apply to this user in this namespace ("": cluster scope)."""
        for binding in self.bindings:
            if not self.bound(binding, user):
                continue
            own = binding.get("metadata", {}).get("namespace", "")
            if binding["kind"] == "RoleBinding" and own != namespace:
                continue
            ref = binding.get("roleRef") or {}
            key = ref.get("kind"), (f"{own}/" if ref.get("kind") == "Role" else "/") + str(
                ref.get("name"))
            yield from self.roles.get(key, [])  # type: ignore[arg-type]

    def allows(self, attributes: Attributes) -> bool:
        return any(rule_allows(rule, attributes)
                   for rule in self.rules(attributes.user, attributes.namespace))


def forbidden_message(attributes: Attributes) -> str:
    """`deployments.apps "chat" is forbidden: User "..." cannot create resource
    "deployments" in API group "apps" in the namespace "inference"`"""
    subject = attributes.resource + (f".{attributes.group}" if attributes.group else "")
    subject += f' "{attributes.name}"' if attributes.name else ""
    where = (f'in the namespace "{attributes.namespace}"' if attributes.namespace
             else "at the cluster scope")
    return (f'{subject} is forbidden: User "{attributes.user}" cannot {attributes.verb} '
            f'resource "{attributes.resource_path}" in API group "{attributes.group}" {where}')
