"""Start-up checks, run as a user would: `manage.py` with environment variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_KEY = "k" * 20 + "-production-secret-key-for-the-deploy-check-0123456789"


def manage(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # The product's own settings module and defaults, not the test suite's.
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "DATABASE_URL",
                                  "REDIS_URL", "DATA_DIR", "DJANGO_SETTINGS_MODULE",
                                  "METRICS_TOKEN", "LOGIN_FAILURES_PER_MINUTE"}}
    environment.update({"DATA_DIR": str(tmp_path / "data"), **env})
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=120)


def test_the_development_run_needs_only_debug_on(tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path, DEBUG="true")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data").is_dir()


def test_without_variables_debug_is_off_and_production_settings_are_asked_for(
        tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "SECRET_KEY must be set when DEBUG is false (the default)" in result.stderr
    assert "set DEBUG=true, as `make run` does" in result.stderr


def test_without_a_debug_variable_no_debug_page_is_shown(tmp_path: Path) -> None:
    page = ("from django.test import Client; "
            "r = Client().get('/no-such-page/', HTTP_HOST='fleet.example', secure=True); "
            "print(r.status_code, b'URLconf' in r.content, b'Traceback' in r.content)")
    result = manage("shell", "-c", page, tmp_path=tmp_path, SECRET_KEY=PRODUCTION_KEY,
                    ALLOWED_HOSTS="fleet.example", ALLOW_SQLITE_IN_PRODUCTION="true")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split() == ["404", "False", "False"]


def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path, DEBUG="true", PORT="http")
    assert result.returncode == 2
    assert "configuration error: PORT='http' is not an integer" in result.stderr
    assert "Traceback" not in result.stderr


def test_production_refuses_to_start_without_a_secret_key(tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path, DEBUG="false", ALLOWED_HOSTS="fleet.example")
    assert result.returncode == 2
    assert "SECRET_KEY must be set" in result.stderr


def test_production_refuses_to_start_without_allowed_hosts(tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path, DEBUG="false", SECRET_KEY=PRODUCTION_KEY)
    assert result.returncode == 2
    assert "ALLOWED_HOSTS must be set" in result.stderr


def test_production_refuses_sqlite(tmp_path: Path) -> None:
    result = manage("check", tmp_path=tmp_path, DEBUG="false", SECRET_KEY=PRODUCTION_KEY,
                    ALLOWED_HOSTS="fleet.example")
    assert result.returncode == 2
    assert "production needs PostgreSQL" in result.stderr


@pytest.mark.postgres
def test_the_deploy_check_passes_in_production(tmp_path: Path) -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", tmp_path=tmp_path,
                    DEBUG="false", SECRET_KEY=PRODUCTION_KEY, ALLOWED_HOSTS="fleet.example",
                    DATABASE_URL="postgres://postgres@127.0.0.1:5432/test",
                    REDIS_URL="redis://127.0.0.1:6379/0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_earlier_secret_keys_for_a_rotation_come_from_the_environment(
        tmp_path: Path) -> None:
    result = manage("shell", "-c", "from django.conf import settings; "
                    "print(len(settings.SECRET_KEY_FALLBACKS))", tmp_path=tmp_path,
                    DEBUG="true", SECRET_KEY_FALLBACKS=f"{'a' * 50},{'b' * 50}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "2"
