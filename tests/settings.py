"""The settings the test suite and the type checks load: the development run's, as
`make run` has them (DEBUG on unless the environment says otherwise). pytest-django
sets DEBUG off again while tests run, as Django's test runner does.

The variable is set in this process's environment, so the `manage.py` commands and
servers the tests start inherit the same development settings."""

from __future__ import annotations

import os

os.environ.setdefault("DEBUG", "true")

from controlplane.settings import *  # noqa: F403
