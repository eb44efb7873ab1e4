"""A STAND-IN Kubernetes API server for tests (no real API server can run on these
machines): the `kmock` emulator, on its own event loop in a thread so that the synchronous
`kubernetes` client can call it, made to behave like Kubernetes where the code under test
depends on it:

- label selectors in list and watch (`a=b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x)`);
- resourceVersion: every write gets the next one; a list carries the collection's; a watch
  replays what happened after the version it names, and a version older than the stand-in
  keeps (a small, settable window; `expire_watch_history()`) gets a 410 Gone ERROR event;
  a write that names a resourceVersion other than the object's is refused 409;
- validation: names per kind (Services DNS-1035 labels, the rest DNS-1123 subdomains), label
  keys and values, and a Deployment's immutable `spec.selector`, refused 422 with the real
  server's Status;
- server-side apply: an apply of a missing object creates it; field ownership per manager
  (metadata.managedFields on every read); an apply that changes a field another manager
  owns is refused 409 unless forced; a field the applier stops applying is removed when
  nobody else owns it (a Deployment's `spec.replicas` falls back to its default, 1);
  merge patches and the `scale` subresource take ownership of what they change;
- RBAC: requests whose bearer token names a service account (the kubeconfig of
  `write_kubeconfig` names the controller's) are authorized against the Roles and
  RoleBindings of deploy/kubernetes/rbac*.yaml as Kubernetes' RBAC authorizer does, and
  refused 403 with its message. The ClusterPlayer plays cluster components and is not
  checked; neither are requests without a token, unless `anonymous` names a user.

Not modelled: strategic merge of lists (lists are replaced whole, as by a merge patch),
admission, quotas, defaulting beyond a Deployment's replicas, controllers (ClusterPlayer
plays those through the API)."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml
from kmock._internal import dicts as kmock_dicts
from kmock._internal import k8s_dicts

from tests.k8s_standin_rules import (
    Attributes,
    Manager,
    Rbac,
    SelectorError,
    conflict_message,
    forbidden_message,
    go_selector,
    leaves,
    object_errors,
    parse_selector,
    remove_path,
    selected,
)
from tests.k8s_standin_rules import Path as FieldPath

PLAYER_AGENT = "cluster-player"  # the User-Agent of ClusterPlayer's requests
VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
CONTROLLER = "system:serviceaccount:fleetplane:fleetplane-controller"
TOKEN = "test-token"  # write_kubeconfig's token: the controller's service account
DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
RBAC_FILES = (DEPLOY / "rbac.yaml", DEPLOY / "rbac-keda.yaml", DEPLOY / "rbac-monitoring.yaml")
APPLY = "application/apply-patch"
WATCH_WINDOW = 10_000  # events kept for watches that resume from a resourceVersion
KINDS = {"pods": "Pod", "services": "Service", "secrets": "Secret",
         "deployments": "Deployment", "replicasets": "ReplicaSet", "events": "Event",
         "poddisruptionbudgets": "PodDisruptionBudget", "networkpolicies": "NetworkPolicy",
         "horizontalpodautoscalers": "HorizontalPodAutoscaler", "leases": "Lease",
         "scaledobjects": "ScaledObject", "podmonitors": "PodMonitor"}
RESOURCES = ("v1/pods", "v1/services", "v1/secrets", "v1/events", "apps/v1/deployments",
             "apps/v1/replicasets", "policy/v1/poddisruptionbudgets",
             "networking.k8s.io/v1/networkpolicies",
             "autoscaling/v2/horizontalpodautoscalers", "events.k8s.io/v1/events",
             # KEDA's and the Prometheus Operator's: as where they are installed
             "keda.sh/v1alpha1/scaledobjects", "monitoring.coreos.com/v1/podmonitors")


# Plain (non-pointer) bool fields of the kinds the backend applies: Kubernetes serialises
# them with `omitempty`, so `false` is never returned (`*bool` fields such as
# automountServiceAccountToken or allowPrivilegeEscalation keep theirs).
PLAIN_BOOLS = frozenset(("publishNotReadyAddresses", "readOnly", "hostNetwork", "hostPID",
                         "hostIPC", "stdin", "stdinOnce", "tty", "paused"))


def removal_rank(pod: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """The order in which a ReplicaSet removes pods on a scale-down, as Kubernetes ranks
    them (ActivePodsWithRanks): not yet on a node, then Pending before Running, not ready
    before ready, and only then the lowest pod-deletion cost; among equals the newest."""
    metadata, status = pod["metadata"], pod.get("status") or {}
    phase = {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase") or "", 0)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    notes = metadata.get("annotations") or {}
    serial = int(str(metadata.get("name", "")).rsplit("-", 1)[-1] or 0) if str(
        metadata.get("name", "")).rsplit("-", 1)[-1].isdigit() else 0
    return (1 if (pod.get("spec") or {}).get("nodeName") else 0, phase, int(ready),
            int(notes.get("controller.kubernetes.io/pod-deletion-cost", "0")), -serial)


def omit_false_plain_fields(value: Any) -> None:
    """Drop `false` from plain bool fields, as the API server does when it answers."""
    if isinstance(value, dict):
        for key in [k for k, v in value.items() if v is False and k in PLAIN_BOOLS]:
            del value[key]
        for item in value.values():
            omit_false_plain_fields(item)
    elif isinstance(value, list):
        for item in value:
            omit_false_plain_fields(item)


def rbac_documents(paths: Iterable[Path] = RBAC_FILES) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for path in paths:
        with path.open(encoding="utf-8") as handle:
            documents += [doc for doc in yaml.safe_load_all(handle) if doc]
    return documents


class Refusal(Exception):
    """The API server's answer to a request it refuses: a Status object."""

    def __init__(self, code: int, reason: str, message: str,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            status["details"] = self.details
        return status

    def response(self) -> aiohttp.web.StreamResponse:
        return aiohttp.web.json_response(self.status(), status=self.code)


@dataclass
class Change:
    """One entry of the watch history."""

    version: int
    resource: tuple[str, str, str]
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    before: dict[str, Any] | None


def _resource_name(resource: Any) -> tuple[str, str, str]:
    return (resource.group or "", resource.version or "", resource.plural or "")


def _group_version(resource: Any) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def _qualified_kind(resource: Any, obj: dict[str, Any] | None = None) -> str:
    kind = (obj or {}).get("kind") or KINDS.get(resource.plural, resource.plural)
    return f"{kind}.{resource.group}" if resource.group else str(kind)


def _qualified_resource(resource: Any) -> str:
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def invalid(resource: Any, name: str, errors: list[tuple[str, str, str]],
            obj: dict[str, Any] | None = None) -> Refusal:
    """422 Invalid, worded and shaped as the API server's field errors."""
    causes = [{"reason": "FieldValueInvalid", "field": where, "message": (
        f"Invalid value: {value if value.startswith('v1.') else json.dumps(value)}: {detail}")}
              for where, value, detail in errors]
    parts = [f"{c['field']}: {c['message']}" for c in causes]
    what = _qualified_kind(resource, obj)
    listed = parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"
    return Refusal(422, "Invalid", f'{what} "{name}" is invalid: {listed}', {
        "name": name, "group": resource.group or "",
        "kind": (obj or {}).get("kind") or KINDS.get(resource.plural, resource.plural),
        "causes": causes})


def not_found(resource: Any, name: str) -> Refusal:
    return Refusal(404, "NotFound", f'{_qualified_resource(resource)} "{name}" not found',
                   {"name": name, "group": resource.group or "", "kind": resource.plural})


class StandInApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with the checks and bookkeeping of a real API server (see above).
    Every change happens in `_handle`, before kmock's reactions (a test's injected answer
    still wins, and the change is still made, as in kmock); the fallbacks then answer."""

    #: Requests served, by HTTP method (the benchmark checks a resync writes nothing).
    methods: dict[str, int]
    #: (API group, resource[/subresource], RBAC verb) of every request but the player's.
    verbs: set[tuple[str, str, str]]
    #: What the authorizer was asked, request by request (the player's requests excepted).
    authorizations: list[Attributes]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.forget_requests = False
        self.methods, self.verbs, self.authorizations = {}, set(), []
        self.rbac: Rbac | None = Rbac(rbac_documents())
        self.tokens = {TOKEN: CONTROLLER}
        self.anonymous: str | None = None
        #: What GET /version answers (Kubernetes 1.36 unless a test says otherwise).
        self.server_version = {"major": "1", "minor": "36", "gitVersion": "v1.36.0",
                               "platform": "linux/amd64"}
        self.version = 1  # never "0", which a watch reads as "from any version"
        self.log: list[Change] = []
        self.compacted = 0  # the newest resourceVersion a watch can no longer resume from
        self.window = WATCH_WINDOW
        self.tick = asyncio.Event()  # replaced on each change; set to wake the watches
        self.managers: dict[Any, dict[tuple[str, str, str], Manager]] = {}
        self.results: dict[int, Any] = {}
        self.pod_logs: dict[tuple[str, str], str] = {}

    # --- the request path ------------------------------------------------------------

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if self.forget_requests:
            # kmock keeps every request and scans them all to match each new one (O(n)
            # per request); a benchmark that injects nothing keeps only the current one.
            del self._requests[:-1]
        method = str(getattr(request.method, "name", request.method)).upper()
        self.methods[method] = self.methods.get(method, 0) + 1
        if request.resource is None:  # discovery and the like
            if method == "GET" and str(request.url.path).rstrip("/") == "/version":
                # kmock answers only /version (not the client's /version/), as 1.26.
                return aiohttp.web.json_response(self.server_version)
            return await kmock.RawHandler._handle(self, request)
        try:
            user = self.user(request)
            if not _from_player(request):
                exists = self.current(request) is not None
                for attributes in self.attributes(request, method, user, exists):
                    self.authorize(attributes)
            result = self.change(request, method)
        except Refusal as refusal:
            return refusal.response()
        if request.action is None and result is not None:  # PUT: kmock has no action
            return aiohttp.web.json_response(result)
        self.results[id(request)] = result
        try:
            return await kmock.RawHandler._handle(self, request)
        finally:
            self.results.pop(id(request), None)

    def user(self, request: Any) -> str | None:
        """Who sends the request: None for the cluster's own components (the player)."""
        headers = {str(k).lower(): v for k, v in request.headers.items()}
        if _from_player(request):
            return None
        credentials = str(headers.get("authorization", ""))
        if credentials.lower().startswith("bearer "):
            token = credentials[7:].strip()
            if token not in self.tokens:
                raise Refusal(401, "Unauthorized", "Unauthorized")
            return self.tokens[token]
        return self.anonymous

    @staticmethod
    def attributes(request: Any, method: str, user: str | None,
                   exists: bool) -> list[Attributes]:
        """What Kubernetes' authorizer checks for this request: the verb from the method,
        and for an apply of a missing object `create` as well as `patch`."""
        if method == "GET":
            verb = ("watch" if request.params.get("watch") in ("true", "1")
                    else "get" if request.name else "list")
        elif method == "DELETE" and not request.name:
            verb = "deletecollection"
        else:
            verb = VERBS.get(method, method.lower())
        base = Attributes(user or "system:anonymous", verb, request.resource.group or "",
                          request.resource.plural or "", request.subresource or "",
                          request.namespace or "", request.name or "")
        found = [base]
        if verb == "patch" and _is_apply(request) and not exists and not request.subresource:
            found.append(Attributes(base.user, "create", base.group, base.resource, "",
                                    base.namespace, base.name))
        return found

    def authorize(self, attributes: Attributes) -> None:
        self.authorizations.append(attributes)
        self.verbs.add((attributes.group, attributes.resource_path, attributes.verb))
        checked = attributes.user != "system:anonymous" or self.anonymous is not None
        if self.rbac is not None and checked and not self.rbac.allows(attributes):
            raise Refusal(403, "Forbidden", forbidden_message(attributes), {
                "name": attributes.name, "group": attributes.group,
                "kind": attributes.resource})

    def current(self, request: Any) -> k8s_dicts.Object | None:
        if not request.name:
            return None
        stored = self._objects._objects.get((request.resource, request.namespace,
                                             request.name))
        return None if stored is None or stored.deleted else stored

    def change(self, request: Any, method: str) -> Any:
        """Make the change a write asks for (or check a read's parameters); returns what
        the answer carries."""
        if method == "GET":
            if "labelSelector" in request.params:
                try:
                    parse_selector(request.params["labelSelector"])
                except SelectorError as exc:
                    raise Refusal(400, "BadRequest", str(exc)) from None
            return None
        manager = str(request.params.get("fieldManager") or "")
        if not manager:  # as the API server names an unnamed manager: by its User-Agent
            agent = {str(k).lower(): v for k, v in request.headers.items()}.get(
                "user-agent", "unknown")
            manager = str(agent).split("/")[0]
        stored = self.current(request)
        if method == "POST" and not request.name:
            return self.create(request, self.request_body(request), manager, "Update")
        if method == "DELETE" and request.name:
            return self.remove(request, stored)
        if method not in ("PATCH", "PUT") or not request.name:
            raise Refusal(405, "MethodNotAllowed", "the server does not allow this method "
                          "on the requested resource")
        body = self.request_body(request)
        if request.subresource in ("status", "scale"):
            if stored is None:
                raise not_found(request.resource, request.name)
            return self.update_subresource(request, method, stored, body, manager)
        if request.subresource:
            raise not_found(request.resource, request.name)
        if method == "PATCH" and _is_apply(request):
            return self.apply(request, stored, body, manager)
        if stored is None:
            raise not_found(request.resource, request.name)
        before = stored.raw
        self.precondition(request, before, body)
        if method == "PUT":
            new = copy.deepcopy(body)
            new["status"] = copy.deepcopy(before.get("status", new.get("status")))
        else:
            new = dict(kmock_dicts.patch_dict(copy.deepcopy(before), body))
        return self.update(request, before, new, manager, "Update", "")

    @staticmethod
    def request_body(request: Any) -> Any:
        if request.data is not None:
            return request.data
        if request.text:
            try:
                return yaml.safe_load(request.text)
            except yaml.YAMLError as exc:
                raise Refusal(400, "BadRequest", f"error decoding YAML: {exc}") from None
        return {}

    def precondition(self, request: Any, before: dict[str, Any], body: Any) -> None:
        """A write naming a resourceVersion succeeds only if nobody wrote since."""
        wanted = ((body or {}).get("metadata") or {}).get("resourceVersion") if isinstance(
            body, dict) else None
        if wanted and str(wanted) != before["metadata"]["resourceVersion"]:
            raise Refusal(409, "Conflict", (
                f'Operation cannot be fulfilled on {_qualified_resource(request.resource)} '
                f'"{request.name}": the object has been modified; please apply your changes '
                f"to the latest version and try again"), {
                "name": request.name, "group": request.resource.group or "",
                "kind": request.resource.plural})

    # --- writes ----------------------------------------------------------------------

    def create(self, request: Any, body: Any, manager: str, operation: str) -> dict[str, Any]:
        resource = request.resource
        if not isinstance(body, dict):
            raise Refusal(400, "BadRequest", "the body of the request was not an object")
        metadata = body.setdefault("metadata", {})
        omit_false_plain_fields(body)
        if request.namespace and metadata.get("namespace") not in (None, request.namespace):
            raise Refusal(400, "BadRequest", "the namespace of the provided object does not "
                          "match the namespace sent on the request")
        name = str(request.name or metadata.get("name") or "")
        if not name and metadata.get("generateName"):
            name = f"{metadata['generateName']}{uuid.uuid4().hex[:5]}"
        key = (resource, request.namespace or metadata.get("namespace"), name)
        if self.current(kmock.Request(resource=resource, namespace=key[1], name=name)):
            raise Refusal(409, "AlreadyExists",
                          f'{_qualified_resource(resource)} "{name}" already exists', {
                              "name": name, "group": resource.group or "",
                              "kind": resource.plural})
        obj = copy.deepcopy(body)
        obj["apiVersion"] = _group_version(resource)
        obj.setdefault("kind", KINDS.get(resource.plural, resource.plural))
        obj["metadata"].update({"name": name, "uid": str(uuid.uuid4()),
                                "creationTimestamp": _now()})
        if key[1]:
            obj["metadata"]["namespace"] = key[1]
        obj["metadata"].pop("generateName", None)
        errors = object_errors(resource.plural, obj)
        if errors:
            raise invalid(resource, name, errors, obj)
        if isinstance(obj.get("spec"), dict):
            obj["metadata"]["generation"] = 1
            if resource.plural == "deployments":
                obj["spec"].setdefault("replicas", 1)  # the API server's default
        self.managers[key] = {(manager, operation, ""): Manager(
            manager, operation, _group_version(resource), set(leaves(body)), time=_now())}
        self.commit(key, obj, "ADDED", None)
        return obj

    def apply(self, request: Any, stored: k8s_dicts.Object | None, body: Any,
              manager: str) -> dict[str, Any]:
        """Server-side apply under `manager`: create, or update the fields it applies."""
        resource, name = request.resource, request.name
        if not request.params.get("fieldManager"):
            raise Refusal(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: '
                          "fieldManager: Required value: is required for apply patch")
        if not isinstance(body, dict):
            raise Refusal(400, "BadRequest", "the body of the request was not an object")
        if (body.get("metadata") or {}).get("name") not in (None, name):
            raise Refusal(400, "BadRequest", f"the name of the object "
                          f"({body['metadata']['name']}) does not match the name on the URL "
                          f"({name})")
        if stored is None:
            return self.create(request, body, manager, "Apply")
        before = stored.raw
        key = (resource, request.namespace, name)
        managers = self.managers.setdefault(key, {})
        mine = (manager, "Apply", "")
        applied = leaves(body)
        current = leaves(before)
        conflicts = [(owner, path) for path, value in applied.items()
                     for held, owner in managers.items()
                     if held != mine and path in owner.paths
                     and current.get(path, _MISSING) != value]
        force = str(request.params.get("force", "")).lower() == "true"
        if conflicts and not force:
            raise Refusal(409, "Conflict", conflict_message(conflicts), {
                "name": name, "group": resource.group or "",
                "kind": before.get("kind") or resource.plural,
                "causes": [{"reason": "FieldManagerConflict", "field": _dotted(path),
                            "message": f'conflict with "{owner.name}" using '
                                       f"{owner.api_version}"}
                           for owner, path in conflicts]})
        for owner, path in conflicts:  # forced: the applier takes them
            owner.paths.discard(path)
        new = dict(kmock_dicts.patch_dict(copy.deepcopy(before), body))
        previously = managers[mine].paths if mine in managers else set()
        for path in previously - set(applied):  # no longer applied: gone unless shared
            if not any(path in owner.paths for held, owner in managers.items()
                       if held != mine):
                remove_path(new, path)
        if resource.plural == "deployments" and isinstance(new.get("spec"), dict):
            new["spec"].setdefault("replicas", 1)  # defaulted again, owned by nobody
        managers[mine] = Manager(manager, "Apply", _group_version(resource), set(applied),
                                 time=_now() if set(applied) != previously else (
                                     managers[mine].time if mine in managers else _now()))
        return self.update(request, before, new, manager, "Apply", "")

    def update(self, request: Any, before: dict[str, Any], new: dict[str, Any],
               manager: str, operation: str, subresource: str) -> dict[str, Any]:
        resource, key = request.resource, (request.resource, request.namespace, request.name)
        new.setdefault("metadata", {})
        omit_false_plain_fields(new)
        for field in ("name", "namespace", "uid", "creationTimestamp", "generation"):
            if field in before.get("metadata", {}):
                new["metadata"][field] = before["metadata"][field]
        new["apiVersion"], new["kind"] = before.get("apiVersion"), before.get("kind")
        errors = object_errors(resource.plural, new)
        old_selector = (before.get("spec") or {}).get("selector") if isinstance(
            before.get("spec"), dict) else None
        new_selector = (new.get("spec") or {}).get("selector") if isinstance(
            new.get("spec"), dict) else None
        if resource.plural == "deployments" and old_selector and new_selector != old_selector:
            errors.append(("spec.selector", go_selector(new_selector), "field is immutable"))
        if errors:
            raise invalid(resource, str(request.name), errors, before)
        managers = self.managers.setdefault(key, {})
        if operation == "Update":  # a non-apply write owns what it changed
            was, now = leaves(before), leaves(new)
            changed = {path for path, value in now.items() if was.get(path, _MISSING) != value}
            for owner in managers.values():
                owner.paths -= changed
            if changed:
                entry = managers.setdefault((manager, "Update", subresource), Manager(
                    manager, "Update", _group_version(resource), subresource=subresource))
                entry.paths |= changed
                entry.time = _now()
        present = set(leaves(new))
        for held in list(managers):
            managers[held].paths &= present
            if not managers[held].paths:
                del managers[held]
        if new.get("spec") != before.get("spec") and "generation" in new["metadata"]:
            new["metadata"]["generation"] = int(new["metadata"]["generation"]) + 1
        entries = [m.entry() for m in managers.values()]
        unchanged = {**new, "metadata": {k: v for k, v in new["metadata"].items()
                                         if k not in ("resourceVersion", "managedFields")}}
        old = {**before, "metadata": {k: v for k, v in before["metadata"].items()
                                      if k not in ("resourceVersion", "managedFields")}}
        if unchanged == old and entries == before["metadata"].get("managedFields"):
            return before  # nothing changed: no new resourceVersion, no watch event
        self.commit(key, new, "MODIFIED", before)
        return new

    def update_subresource(self, request: Any, method: str, stored: k8s_dicts.Object,
                           body: Any, manager: str) -> dict[str, Any]:
        before = stored.raw
        self.precondition(request, before, body)
        new = copy.deepcopy(before)
        if request.subresource == "status":
            status = (body or {}).get("status")
            new["status"] = (copy.deepcopy(status) if method == "PUT" else dict(
                kmock_dicts.patch_dict(new.get("status") or {}, status or {})))
            return self.update(request, before, new, manager, "Update", "status")
        if request.resource.plural != "deployments":
            raise not_found(request.resource, request.name)
        replicas = ((body or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(request.resource, request.name, [(
                "spec.replicas", json.dumps(replicas), "must be greater than or equal to 0")],
                before)
        new.setdefault("spec", {})["replicas"] = replicas
        return self.scale(self.update(request, before, new, manager, "Update", "scale"))

    def remove(self, request: Any, stored: k8s_dicts.Object | None) -> dict[str, Any]:
        if stored is None:
            raise not_found(request.resource, request.name)
        key = (request.resource, request.namespace, request.name)
        before = stored.raw
        if (before.get("metadata") or {}).get("finalizers"):
            if before["metadata"].get("deletionTimestamp"):
                return before
            new = copy.deepcopy(before)
            new["metadata"]["deletionTimestamp"] = _now()
            self.commit(key, new, "MODIFIED", before)
            return new
        self.managers.pop(key, None)
        gone = copy.deepcopy(before)
        self.commit(key, gone, "DELETED", before)
        return gone

    def commit(self, key: Any, obj: dict[str, Any], kind: str,
               before: dict[str, Any] | None) -> None:
        """Store a new state under the next resourceVersion and tell the watches."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind != "DELETED":
            obj["metadata"]["managedFields"] = [
                m.entry() for m in self.managers.get(key, {}).values()]
        stored = self._objects._objects.get(key)
        history: list[dict[str, Any] | None] = [obj] if kind != "DELETED" else [obj, None]
        if stored is None:
            self._objects._objects[key] = k8s_dicts.Object(history)
        else:
            stored.history[:] = history  # the latest only: benchmarks write a lot
        self.log.append(Change(self.version, _resource_name(key[0]), key[1] or "", kind, obj,
                               before))
        if len(self.log) > self.window + 1000:  # trimmed in batches
            dropped = len(self.log) - self.window
            self.compacted = self.log[dropped - 1].version
            del self.log[:dropped]
        self.tick.set()
        self.tick = asyncio.Event()

    def expire_watch_history(self) -> None:
        """Forget every change so far: a watch from any older resourceVersion gets 410."""
        self.compacted = self.version
        self.log.clear()

    # --- answers (kmock's fallbacks: a test's own reactions come first) ---------------

    async def _serve_create(self, request: Any) -> Any:
        return self.results.get(id(request))

    async def _serve_update(self, request: Any) -> Any:
        return self.results.get(id(request))

    async def _serve_delete(self, request: Any) -> Any:
        return self.results.get(id(request))

    async def _serve_fetch(self, request: Any) -> Any:
        stored = self.current(request)
        if stored is None:
            raise _as_kmock_error(not_found(request.resource, request.name))
        if request.subresource == "scale":
            return self.scale(stored.raw)
        if request.subresource == "log":
            return self.pod_logs.get((request.namespace, request.name), "").encode()
        return stored.raw

    @staticmethod
    def scale(deployment: dict[str, Any]) -> dict[str, Any]:
        metadata = deployment["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {
            k: metadata[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                     "creationTimestamp") if k in metadata},
            "spec": {"replicas": (deployment.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (deployment.get("status") or {}).get("replicas", 0)}}

    def matching(self, request: Any) -> list[dict[str, Any]]:
        requirements = parse_selector(request.params.get("labelSelector", ""))
        wanted = _resource_name(request.resource)
        return [obj.raw for (resource, namespace, _), obj in self._objects._objects.items()
                if not obj.deleted and _resource_name(resource) == wanted
                and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or obj.raw["metadata"]["name"] == request.name)
                and selected(requirements, obj.raw)]

    async def _serve_list(self, request: Any) -> Any:
        if not any(_resource_name(r) == _resource_name(request.resource)
                   for r in self._get_resources()):
            raise _as_kmock_error(Refusal(404, "NotFound",
                                          "the server could not find the requested resource"))
        kind = KINDS.get(request.resource.plural, request.resource.plural)
        return {"apiVersion": _group_version(request.resource), "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self.version)},
                "items": self.matching(request)}

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        yield b""  # the headers go out at once, as the API server's do
        requirements = parse_selector(request.params.get("labelSelector", ""))
        wanted = _resource_name(request.resource)
        namespace = request.namespace
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else time.monotonic() + timeout
        since = str(request.params.get("resourceVersion") or "")
        if since in ("", "0"):  # from now, beginning with what exists
            cursor = self.version
            for obj in self.matching(request):
                yield {"type": "ADDED", "object": obj}
        else:
            try:
                cursor = int(since)
            except ValueError:
                yield _error_event(400, "BadRequest", f"invalid resource version: {since}")
                return
        while True:
            if cursor < self.compacted:
                yield _error_event(410, "Expired", f"too old resource version: {cursor} "
                                   f"({self.compacted + 1})")
                return
            tick = self.tick
            start = cursor + 1 - self.log[0].version if self.log else len(self.log)
            events = []
            for change in self.log[max(start, 0):]:
                cursor = change.version
                if change.resource != wanted or (namespace is not None
                                                 and change.namespace != namespace):
                    continue
                event = _event_for(change, requirements)
                if event is not None:
                    events.append(event)
            for event in events:
                yield event
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(tick.wait(), remaining)
            except TimeoutError:
                return


ApplyingEmulator = StandInApiServer  # the name earlier tests and benchmarks know
_MISSING = object()


def _dotted(path: FieldPath) -> str:
    return "".join(f".{part}" for part in path)


def _from_player(request: Any) -> bool:
    headers = {str(k).lower(): v for k, v in request.headers.items()}
    return headers.get("user-agent") == PLAYER_AGENT


def _is_apply(request: Any) -> bool:
    headers = {str(k).lower(): v for k, v in request.headers.items()}
    return str(headers.get("content-type", "")).startswith(APPLY)


def _error_event(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"type": "ERROR", "object": Refusal(code, reason, message).status()}


def _event_for(change: Change, requirements: list[Any]) -> dict[str, Any] | None:
    """The event a watch with this selector sees: an object that starts or stops
    matching is ADDED or DELETED for it, as the API server does."""
    now = selected(requirements, change.obj)
    was = change.before is not None and selected(requirements, change.before)
    if change.type == "ADDED":
        kind = "ADDED" if now else None
    elif change.type == "DELETED":
        kind = "DELETED" if now else None
    else:
        kind = ("MODIFIED" if now and was else "ADDED" if now else
                "DELETED" if was else None)
    return None if kind is None else {"type": kind, "object": change.obj}


def _as_kmock_error(refusal: Refusal) -> Exception:
    from kmock._internal.k8s import KubernetesError

    return KubernetesError(status=refusal.code, reason=refusal.reason,
                           message=refusal.message, details=refusal.details or {})


class EmulatedCluster:
    """The stand-in API server serving on 127.0.0.1 from a background thread.

    `authorize`: check the requests of service-account tokens against the Roles of
    deploy/kubernetes/rbac*.yaml (`use_rbac` changes them); `anonymous`: the user that
    requests without a token count as (None: not checked, as a cluster admin's calls);
    `watch_window`: how many changes a watch can resume across."""

    def __init__(self, *, forget_requests: bool = False, authorize: bool = True,
                 anonymous: str | None = None, watch_window: int = WATCH_WINDOW) -> None:
        self.forget_requests = forget_requests
        self.authorize, self.anonymous, self.watch_window = authorize, anonymous, watch_window
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        self.emulator: StandInApiServer | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.main(),), daemon=True)

    async def main(self) -> None:
        self.stopping = asyncio.Event()
        async with StandInApiServer() as emulator, kmock.Server(emulator) as server:
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            emulator.forget_requests = self.forget_requests
            emulator.anonymous, emulator.window = self.anonymous, self.watch_window
            if not self.authorize:
                emulator.rbac = None
            for resource in RESOURCES:
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

    def server(self) -> StandInApiServer:
        assert self.emulator is not None, "the stand-in API server is not started"
        return self.emulator

    def use_rbac(self, documents: Iterable[dict[str, Any]] | None) -> None:
        """Authorize against these Role/RoleBinding documents from now on (None: no
        authorization at all)."""
        rbac = None if documents is None else Rbac(list(documents))
        self.call(lambda: setattr(self.server(), "rbac", rbac))

    def expire_watch_history(self) -> None:
        """As when the API server's watch cache moves on: a watch from any resourceVersion
        seen so far is answered 410 Gone."""
        self.call(lambda: self.server().expire_watch_history())

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

            for victim in sorted(live, key=removal_rank)[:max(0, len(live) - wanted)]:
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

    def kubectl_scale(self, deployment: str, replicas: int, manager: str = "kubectl") -> None:
        """`kubectl scale deployment/<name> --replicas=N`: the scale subresource, under its
        field manager (which then owns `spec.replicas`)."""
        self.apps.patch_namespaced_deployment_scale(
            deployment, self.namespace, {"spec": {"replicas": replicas}},
            field_manager=manager, _content_type="application/merge-patch+json")

    def kubectl_patch(self, deployment: str, patch: dict[str, Any],
                      manager: str = "kubectl") -> None:
        """`kubectl patch deployment/<name> --type merge -p ...`."""
        self.apps.patch_namespaced_deployment(
            deployment, self.namespace, patch, field_manager=manager,
            _content_type="application/merge-patch+json")

    def keda_hpa(self, scaled_object: str) -> str:
        """What KEDA's operator makes for a ScaledObject: an HPA `keda-hpa-<name>` carrying
        all of the ScaledObject's labels, owned by it (ownerReferences)."""
        from kubernetes import client

        found: Any = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            "keda.sh", "v1alpha1", self.namespace, "scaledobjects", scaled_object)
        metadata = found["metadata"]
        name = f"keda-hpa-{scaled_object}"
        body: Any = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": dict(metadata.get("labels") or {}),
                     "ownerReferences": [{
                         "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                         "name": scaled_object, "uid": metadata.get("uid") or "uid",
                         "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                    "name": scaled_object},
                 "minReplicas": 1, "maxReplicas": 4}}
        client.AutoscalingV2Api(self.api).create_namespaced_horizontal_pod_autoscaler(
            self.namespace, body)
        return name

    def hpa_scale(self, deployment: str, replicas: int) -> None:
        """The HorizontalPodAutoscaler controller sets the count through the scale
        subresource, as `horizontal-pod-autoscaler`."""
        body = self.client.V1Scale(metadata=self.client.V1ObjectMeta(name=deployment),
                                   spec=self.client.V1ScaleSpec(replicas=replicas))
        self.apps.replace_namespaced_deployment_scale(
            deployment, self.namespace, body, field_manager="horizontal-pod-autoscaler")

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
