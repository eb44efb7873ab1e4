"""What Django's debug pages (DEBUG on) and error reports may show.

Django hides settings whose names look secret (KEY, TOKEN, PASS, ...). Settings here
also hold URLs with credentials in them (REDIS_URL, the Redis channel layer's hosts,
backend configs), under names that do not look secret: their user and password are
replaced wherever they appear, in settings, in the variables of the traceback's frames
and in the request's headers.
"""

from __future__ import annotations

import re
from typing import Any

from django.http import HttpRequest
from django.views.debug import SafeExceptionReporterFilter

# scheme://user:password@host or scheme://token@host
CREDENTIALS_IN_URL = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^/@\s'\"]+@", re.I)


def hide_url_credentials(text: str) -> str:
    return CREDENTIALS_IN_URL.sub(r"\g<scheme>********@", text)


class CredentialHidingFilter(SafeExceptionReporterFilter):
    hidden_settings = re.compile(
        "API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|AUTHORIZATION|CREDENTIAL|PRIVATE"
        "|DSN|SESSION", flags=re.I)

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str):
            return hide_url_credentials(cleansed)
        return cleansed

    def get_traceback_frame_variables(self, request: HttpRequest | None,
                                      tb_frame: Any) -> Any:
        variables = super().get_traceback_frame_variables(request, tb_frame)
        return [(name, self.cleanse_variable(name, value)) for name, value in variables]

    def cleanse_variable(self, name: str, value: Any) -> Any:
        if isinstance(value, str | dict | list | tuple):
            return self.cleanse_setting(name, value)
        # Other objects are shown by their repr, which may hold a URL too.
        text = repr(value)
        hidden = hide_url_credentials(text)
        return value if hidden == text else hidden
