"""`manage.py serve` with production settings (DEBUG off), as a user starts it: the first
admin password never reaches the server's log."""

from __future__ import annotations

import stat
from pathlib import Path

from tests.processes import free_port, manage, server_env, start_server, stop_server

PRODUCTION_KEY = "k" * 20 + "-production-secret-key-for-the-serve-check-0123456789"


def test_in_production_the_first_admin_password_goes_to_an_owner_only_file(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = server_env(data, DEBUG="false", SECRET_KEY=PRODUCTION_KEY,
                      ALLOWED_HOSTS="127.0.0.1", ALLOW_SQLITE_IN_PRODUCTION="true",
                      SECURE_SSL_REDIRECT="false")
    manage(env, "migrate", "--noinput", "-v0")
    process, output = start_server(env, free_port(), "--no-controllers")
    stop_server(process)
    secret_file = data / "initial-admin-password"
    password = secret_file.read_text().strip()
    assert len(password) >= 16
    assert password not in output
    assert f"Log in as 'admin' with the password in {secret_file}" in output
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    check = ("from django.contrib.auth import authenticate; "
             f"print(authenticate(username='admin', password={password!r}) is not None)")
    assert manage(env, "shell", "-c", check).stdout.splitlines()[-1] == "True"
