"""A database outage, told once: the controllers' loops (reconcile, autoscale, collect) go
on trying every pass while the database does not answer, and say so when it stops and when
it answers again, instead of a traceback every pass."""

from __future__ import annotations

import logging

from django.db import InterfaceError, OperationalError


class DatabaseOutage:
    """Follows one loop's passes: `failed` with each error, `succeeded` after each pass."""

    def __init__(self, loop: str, logger: logging.Logger) -> None:
        self.loop = loop
        self.logger = logger
        self.away = False

    def failed(self, error: BaseException) -> None:
        """Log a failed pass: a database out of reach once, anything else in full."""
        if not isinstance(error, OperationalError | InterfaceError):
            self.logger.error("%s pass failed", self.loop, exc_info=error)
            return
        if not self.away:
            self.logger.warning("%s paused: the database does not answer (%s); trying again "
                                "every pass", self.loop, error)
        self.away = True

    def succeeded(self) -> None:
        """A pass went through: an outage, if any, is over."""
        if self.away:
            self.logger.warning("%s resumed: the database answers again", self.loop)
        self.away = False
