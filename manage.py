#!/usr/bin/env python
"""Django's command-line utility for the control plane."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    from controlplane.envconfig import SettingError

    try:
        execute_from_command_line(sys.argv)
    except SettingError as exc:
        # A bad environment variable: say which, without a traceback.
        sys.stderr.write(f"configuration error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
