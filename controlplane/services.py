"""State changes of the control plane: accounts, backends, deployments.

Each function validates, writes in one transaction, records an audit event, and asks the
reconciler for a pass once the transaction has committed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from access.redaction import keep_redacted, redact
from controlplane.audit_log import record_event
from controlplane.autoscaler.policy import Policy, PolicyError
from controlplane.backends.base import validate_backend_config
from controlplane.backends.k8s_names import object_name
from controlplane.engine_args import engine_args_misfit, validate_engine_args
from controlplane.models import Backend, Deployment
from controlplane.wakeups import request_reconcile
from models_registry.models import Model

LOCAL_ADMIN_USERNAME = "admin"


class DeploymentError(ValueError):
    """A request about a deployment cannot be carried out; `field` names the input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class NameTakenError(DeploymentError):
    """The name is already used by another record (a conflict, not bad input)."""


@transaction.atomic
def ensure_local_admin() -> tuple[str, str | None]:
    """Make sure someone can log in. Creates the local admin on first start with a
    generated password, returned once (only its hash is stored). Returns the username and
    the password, or None for the password when an administrator already existed."""
    users = get_user_model()
    existing = users.objects.filter(is_superuser=True, is_active=True).order_by("pk").first()
    if existing is not None:
        return existing.get_username(), None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(LOCAL_ADMIN_USERNAME, email="", password=password)
    return LOCAL_ADMIN_USERNAME, password


def audit(actor: str, action: str, deployment: Deployment | None, message: str,
          before: Any = None, after: Any = None, *, replica: str = "") -> None:
    """Record who changed what, or what a controller did and saw; a repeat of an event
    seen within EVENT_COALESCE_SECONDS is counted on it (controlplane/audit_log.py).
    Secrets never reach the log: every value passes through redaction
    (access/redaction.py) on the way in."""
    record_event(actor, action, deployment, replica, redact(message), redact(before),
                 redact(after))


def spec_of(deployment: Deployment) -> dict[str, Any]:
    """The spec as events record it, before and after a change."""
    return {"model": deployment.model.name, "backend": deployment.backend.name,
            "engine_args": deployment.engine_args, "replicas": deployment.replicas,
            "min_replicas": deployment.min_replicas, "max_replicas": deployment.max_replicas,
            "standby": deployment.standby, "state": deployment.state,
            "autoscaling": deployment.autoscaling, "admission": deployment.admission}


@transaction.atomic
def create_backend(name: str, kind: str, config: dict[str, Any], *, actor: str) -> Backend:
    """A new backend with checked settings; refuses a name in use."""
    if Backend.objects.filter(name=name).exists():
        raise NameTakenError("name", f"a backend named {name!r} already exists")
    backend = Backend.objects.create(name=name, kind=kind,
                                     config=validate_backend_config(kind, config))
    audit(actor, "backend-created", None, f"backend {name} ({kind}) created",
          after={"kind": kind, "config": backend.config})
    return backend


@transaction.atomic
def update_backend(backend: Backend, config: dict[str, Any], *, actor: str) -> Backend:
    """Replace a backend's settings. A secret sent back as it was shown (`***`) keeps its
    stored value: a client may read a config, change one setting and send it all back."""
    backend = Backend.objects.select_for_update().get(pk=backend.pk)
    before = backend.config
    config = validate_backend_config(backend.kind, keep_redacted(config, before))
    if config != before:
        backend.config = config
        backend.save(update_fields=["config"])
        audit(actor, "backend-changed", None, f"backend {backend.name} changed",
              before={"config": before}, after={"config": config})
        transaction.on_commit(request_reconcile)
    return backend


def check_counts(replicas: int, min_replicas: int, max_replicas: int) -> None:
    """min_replicas <= replicas <= max_replicas; raises DeploymentError."""
    if min_replicas > max_replicas:
        raise DeploymentError("min_replicas", f"min_replicas ({min_replicas}) is above "
                                              f"max_replicas ({max_replicas})")
    if not min_replicas <= replicas <= max_replicas:
        raise DeploymentError("replicas", f"{replicas} is outside min_replicas..max_replicas "
                                          f"({min_replicas}..{max_replicas})")


def check_model(model: Model, engine_args: dict[str, Any], backend: Backend) -> None:
    """The model can be served there with these engine args; raises DeploymentError."""
    if backend.kind == Backend.Kind.LOCAL and not model.is_ready():
        raise DeploymentError("model", f"model {model.name} is {model.status}, not ready")
    misfit = engine_args_misfit(engine_args, model)
    if misfit:
        field, message = next(iter(misfit.items()))
        raise DeploymentError(f"engine_args.{field}", message)


@dataclass
class DeploymentSpec:
    """What a new deployment is asked to be."""

    name: str
    model: Model
    backend: Backend
    engine_args: dict[str, Any]
    replicas: int = 1
    min_replicas: int = 0
    max_replicas: int = 4
    standby: int = 0
    routing_policy: str = "least-load"
    aliases: list[str] = field(default_factory=list)
    autoscaling: dict[str, Any] | None = None
    admission: dict[str, Any] | None = None


ADMISSION_FIELDS = ("replica_concurrency", "long_prompt_tokens", "long_replicas")


def check_admission(raw: Any, max_replicas: int) -> dict[str, Any] | None:
    """The admission settings in their stored form, or None; raises DeploymentError."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DeploymentError("admission", "admission must be an object with "
                                           + ", ".join(ADMISSION_FIELDS))
    unknown = sorted(set(raw) - set(ADMISSION_FIELDS))
    if unknown:
        raise DeploymentError(f"admission.{unknown[0]}", "unknown setting; admission takes "
                                                         + ", ".join(ADMISSION_FIELDS))
    out: dict[str, Any] = {}
    for name, low, high in (("replica_concurrency", 1, 100_000),
                            ("long_prompt_tokens", 1, 10_000_000),
                            ("long_replicas", 1, 1000)):
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise DeploymentError(f"admission.{name}",
                                  f"must be a whole number from {low} to {high}")
        out[name] = value
    if ("long_prompt_tokens" in out) != ("long_replicas" in out):
        missing = "long_replicas" if "long_prompt_tokens" in out else "long_prompt_tokens"
        raise DeploymentError(f"admission.{missing}", "context pools need both "
                                                      "long_prompt_tokens and long_replicas")
    if out.get("long_replicas", 0) >= max(max_replicas, 1):
        raise DeploymentError("admission.long_replicas",
                              "must be below max_replicas: the short pool needs a replica")
    return out or None


def check_autoscaling(raw: Any, min_replicas: int, max_replicas: int
                      ) -> dict[str, Any] | None:
    """The policy in its stored form, or None; raises DeploymentError naming the field."""
    if raw is None:
        return None
    try:
        return Policy.from_dict(raw, min_replicas=min_replicas,
                                max_replicas=max_replicas).as_dict()
    except PolicyError as exc:
        field_name = exc.field if exc.field.startswith("autoscaling") or exc.field in (
            "min_replicas", "max_replicas") else f"autoscaling.{exc.field}"
        raise DeploymentError(field_name, exc.message) from None


def check_names(name: str, served: str, aliases: list[str], exclude: int | None = None) -> None:
    """Every model name a client may use must lead to one deployment only."""
    wanted = {name, served, *aliases}
    others = Deployment.objects.filter(deleting=False)
    if exclude is not None:
        others = others.exclude(pk=exclude)
    for other in others:
        taken = {other.name, other.served_model_name(), *other.aliases}
        clash = sorted(wanted & taken)
        if clash:
            raise DeploymentError("aliases", f"the model name {clash[0]!r} is already used by "
                                             f"deployment {other.name}")


def check_object_name(name: str) -> None:
    """Two deployments never name the same Kubernetes objects: a name that is another's
    transformed object name (`d-8b-chat-1b6d24b4` beside `8b-chat`) is refused."""
    wanted = object_name(name)
    for other in Deployment.objects.values_list("name", flat=True):
        if object_name(other) == wanted:
            raise NameTakenError("name", f"{name!r} would name the same Kubernetes objects "
                                         f"({wanted}) as deployment {other!r}")


@transaction.atomic
def create_deployment(spec: DeploymentSpec, *, actor: str) -> Deployment:
    """A new deployment from a checked spec; the reconciler starts its replicas."""
    if Deployment.objects.filter(name=spec.name).exists():
        raise NameTakenError("name", f"a deployment named {spec.name!r} already exists")
    check_object_name(spec.name)
    engine_args = validate_engine_args(spec.engine_args)
    check_model(spec.model, engine_args, spec.backend)
    check_counts(spec.replicas, spec.min_replicas, spec.max_replicas)
    check_names(spec.name, str(engine_args.get("served_model_name") or spec.name), spec.aliases)
    autoscaling = check_autoscaling(spec.autoscaling, spec.min_replicas, spec.max_replicas)
    admission = check_admission(spec.admission, spec.max_replicas)
    deployment = Deployment.objects.create(
        name=spec.name, model=spec.model, backend=spec.backend, engine_args=engine_args,
        replicas=spec.replicas, min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas, standby=spec.standby,
        routing_policy=spec.routing_policy, aliases=spec.aliases, autoscaling=autoscaling,
        admission=admission,
    )
    audit(actor, "deployment-created", deployment, f"deployment {spec.name} created",
          after=spec_of(deployment))
    transaction.on_commit(request_reconcile)
    return deployment


@transaction.atomic
def update_deployment(deployment: Deployment, changes: dict[str, Any], *,
                      actor: str) -> Deployment:
    """Change a deployment's spec. New engine args or a new model start a rollout."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    before = spec_of(deployment)
    rollout = False
    if "engine_args" in changes:
        engine_args = validate_engine_args(changes["engine_args"])
        if engine_args != deployment.engine_args:
            deployment.engine_args, rollout = engine_args, True
    if "model" in changes and changes["model"] != deployment.model:
        deployment.model, rollout = changes["model"], True
    for name in ("replicas", "min_replicas", "max_replicas", "standby", "routing_policy",
                 "aliases", "autoscaling", "admission"):
        if name in changes:
            setattr(deployment, name, changes[name])
    deployment.autoscaling = check_autoscaling(deployment.autoscaling,
                                               deployment.min_replicas,
                                               deployment.max_replicas)
    deployment.admission = check_admission(deployment.admission, deployment.max_replicas)
    check_model(deployment.model, deployment.engine_args, deployment.backend)
    check_names(deployment.name, deployment.served_model_name(), deployment.aliases,
                exclude=deployment.pk)
    check_counts(deployment.replicas, deployment.min_replicas, deployment.max_replicas)
    if rollout:
        deployment.generation += 1
    deployment.save()
    audit(actor, "deployment-updated", deployment, f"deployment {deployment.name} updated"
          + (f" (rollout to generation {deployment.generation})" if rollout else ""),
          before=before, after=spec_of(deployment))
    transaction.on_commit(request_reconcile)
    return deployment


@transaction.atomic
def scale_deployment(deployment: Deployment, replicas: int, *, actor: str) -> Deployment:
    """Set the replica count (lowering min_replicas with it when needed)."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    if replicas < 0:
        raise DeploymentError("replicas", "must be 0 or more")
    if replicas > deployment.max_replicas:
        raise DeploymentError("replicas", f"{replicas} is above max_replicas "
                                          f"({deployment.max_replicas})")
    before = deployment.replicas
    min_replicas = min(deployment.min_replicas, replicas)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=replicas,
                                                       min_replicas=min_replicas)
    deployment.replicas, deployment.min_replicas = replicas, min_replicas
    audit(actor, "deployment-scaled", deployment,
          f"deployment {deployment.name} scaled from {before} to {replicas}",
          before={"replicas": before}, after={"replicas": replicas})
    transaction.on_commit(request_reconcile)
    return deployment


@transaction.atomic
def set_deployment_state(deployment: Deployment, state: str, *, actor: str) -> Deployment:
    """Stop or start a deployment; the reconciler takes its replicas down or up."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    before = deployment.state
    if state == before:
        return deployment
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    deployment.state = state
    audit(actor, "deployment-stopped" if state == Deployment.State.STOPPED else
          "deployment-started", deployment, f"deployment {deployment.name} {state}",
          before={"state": before}, after={"state": state})
    transaction.on_commit(request_reconcile)
    return deployment


@transaction.atomic
def restart_deployment(deployment: Deployment, *, actor: str) -> Deployment:
    """A rolling restart: a new generation; each new replica is ready before an old one
    drains."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    deployment.generation += 1
    Deployment.objects.filter(pk=deployment.pk).update(generation=deployment.generation)
    audit(actor, "deployment-restarted", deployment,
          f"rolling restart of {deployment.name} (generation {deployment.generation})")
    transaction.on_commit(request_reconcile)
    return deployment


@transaction.atomic
def delete_deployment(deployment: Deployment, *, actor: str) -> Deployment:
    """Drain every replica; the reconciler removes the deployment once none is left."""
    Deployment.objects.filter(pk=deployment.pk).update(deleting=True)
    deployment.deleting = True
    audit(actor, "deployment-deleting", deployment,
          f"deployment {deployment.name} is being deleted", before=spec_of(deployment))
    transaction.on_commit(request_reconcile)
    return deployment


def default_local_backend() -> Backend:
    """The backend deployments use when none is named: local processes."""
    backend, created = Backend.objects.get_or_create(
        name="local", defaults={"kind": Backend.Kind.LOCAL,
                                "config": {"kv_cache_gib": settings.LOCAL_KV_CACHE_GIB}})
    if created:
        audit("system", "backend-created", None, "backend local (local) created",
              after={"kind": backend.kind, "config": backend.config})
    if backend.kind != Backend.Kind.LOCAL:
        raise DeploymentError("backend", "the backend named 'local' is not a local backend; "
                                         "name a backend explicitly")
    return backend
