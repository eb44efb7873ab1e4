"""Access that ends while a socket is open: when a user is changed (role, active flag,
deleted), their open dashboard and playground sockets re-check the role at once, through
the channel layer (every process with Redis), and close if it no longer suffices; the
playground's running generations stop with them. Every socket also re-checks on its own
every KEY_CACHE_SECONDS, for processes that share no channel layer."""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save

logger = logging.getLogger(__name__)


def user_group(user_id: int) -> str:
    return f"access.user.{user_id}"


def tell_sockets(user_id: int) -> None:
    """Ask the user's open sockets to check their access again (after the commit)."""

    def send() -> None:
        from asgiref.sync import async_to_sync
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(user_group(user_id), {"type": "access.changed"})
        except Exception:
            logger.exception("could not tell user %s's open sockets that their access "
                             "changed", user_id)

    transaction.on_commit(send)


def user_changed(sender: Any, instance: Any, **kwargs: Any) -> None:
    if instance.pk is not None:
        tell_sockets(instance.pk)


def groups_changed(sender: Any, instance: Any, action: str, reverse: bool,
                   pk_set: set[int] | None, **kwargs: Any) -> None:
    if not action.startswith("post_"):
        return
    if reverse:  # a group's members changed: each of them
        for user_id in pk_set or ():
            tell_sockets(user_id)
    else:
        tell_sockets(instance.pk)


def connect() -> None:
    users = get_user_model()
    post_save.connect(user_changed, sender=users, dispatch_uid="revocation.user-save")
    post_delete.connect(user_changed, sender=users, dispatch_uid="revocation.user-delete")
    m2m_changed.connect(groups_changed, sender=users.groups.through,
                        dispatch_uid="revocation.user-groups")
