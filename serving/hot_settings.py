"""The Django settings the gateway reads on every request, as plain attributes.

Reading `django.conf.settings.X` runs Django's LazyObject.__getattribute__ in Python each
time (about a microsecond; a request read about ten). `hot.X` is read from settings once,
then kept, and forgotten whenever a setting changes (Django's `setting_changed` signal,
sent by override_settings and pytest-django's `settings` fixture), so a changed setting
still takes effect at once.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed


class HotSettings:
    """`hot.NAME` is `settings.NAME`, kept after the first read."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(settings, name)
        self.__dict__[name] = value  # later reads find it without calling this
        return value

    def forget(self, **_: Any) -> None:
        """Read every setting again on next use."""
        self.__dict__.clear()


hot = HotSettings()
setting_changed.connect(hot.forget, weak=False)
