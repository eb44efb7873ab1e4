"""How the Kubernetes backend names and labels what it makes for a deployment: one object
name per deployment, valid for every kind (`object_name`), the owner labels every object
carries and selects by (the deployment's name and the install, never a database id), and
the field manager of server-side apply."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controlplane.models import Deployment

FIELD_MANAGER = "fleetplane"
MANAGED_BY = "fleetplane"
APP_NAME = "vllm"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Which install made an object (settings.INSTALL_ID): in every selector, so two installs
# sharing a namespace never list, adopt or delete each other's objects.
INSTALL_LABEL = "fleetplane.io/install"
DEFAULT_INSTALL_ID = "fleetplane"
ROLE_LABEL = "fleetplane.io/role"
# On the pod template: a new generation (changed engine args, a restart) rolls the pods.
GENERATION_ANNOTATION = "fleetplane.io/generation"
ENGINE_KEY_SUFFIX = "-engine-key"
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def install_id() -> str:
    """This install's id (settings.INSTALL_ID), in every selector."""
    from django.conf import settings

    return str(settings.INSTALL_ID)


def managed_labels() -> dict[str, str]:
    """What every object this install manages carries: the selector for listing them all."""
    return {MANAGED_BY_LABEL: MANAGED_BY, INSTALL_LABEL: install_id()}


def object_name(deployment_name: str) -> str:
    """The name of every object made for a deployment: a DNS-1035 label (what a Service
    needs: a lower-case letter first, at most 63 characters), so also a valid DNS-1123
    subdomain for the other kinds and a valid label value. An install other than the
    default is prefixed (`<install>-<name>`). A name that does not fit as it is (`8b-chat`,
    `My_Chat`, too long) is made to: lower-cased, other characters turned to `-`, `d-`
    put before a leading digit, cut to fit, and ended with `-` and 8 hex digits of the
    SHA-256 of the untransformed name (`8b-chat` -> `d-8b-chat-<hash>`). Two names meet
    only when one is literally the other's result, which creating a deployment refuses
    (controlplane/services.py). The same name always gives the same result."""
    install = install_id()
    base = deployment_name if install == DEFAULT_INSTALL_ID else f"{install}-{deployment_name}"
    if DNS_1035_LABEL.match(base):
        return base
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    cleaned = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", base.lower())).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"d-{cleaned}".rstrip("-")
    return f"{cleaned[:63 - len(digest) - 1].rstrip('-')}-{digest}"


def deployment_key(deployment: Deployment) -> str:
    """The deployment's value of INSTANCE_LABEL: how the backend groups what it lists."""
    return object_name(deployment.name)


def owner_labels(deployment: Deployment) -> dict[str, str]:
    """The labels every object made for a deployment carries, and selects by: the name and
    the install, both stable across a database rebuild (not the database id)."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: deployment_key(deployment),
        **managed_labels(),
    }


def selector_changed(live: dict[str, Any], rendered: dict[str, Any]) -> bool:
    """True when a Deployment in the cluster selects otherwise than the rendered one.
    `spec.selector` is immutable: such a Deployment (applied by an older version, which
    selected by the database id) must be deleted and created again, not applied over."""
    if live.get("kind") != "Deployment" or rendered.get("kind") != "Deployment":
        return False
    wanted = rendered["spec"]["selector"]
    found = (live.get("spec") or {}).get("selector") or {}
    return bool((found.get("matchLabels") or {}) != wanted.get("matchLabels", {}) or
                (found.get("matchExpressions") or []) != wanted.get("matchExpressions", []))


def engine_key_secret_name(deployment: Deployment) -> str:
    """The name of the Secret holding the deployment's engine key."""
    return f"{object_name(deployment.name)}{ENGINE_KEY_SUFFIX}"
