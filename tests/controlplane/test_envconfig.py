from __future__ import annotations

import pytest

from controlplane.envconfig import (
    SettingError,
    database_from_url,
    env_absolute_paths,
    env_bool,
    env_choice,
    env_int,
    env_labels,
    env_list,
)


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("False", False), ("1", True),
                                                ("off", False)])
def test_booleans_are_read_from_the_usual_spellings(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                    expected: bool) -> None:
    monkeypatch.setenv("FLAG", raw)
    assert env_bool("FLAG", not expected) is expected


def test_an_unset_variable_takes_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLAG", raising=False)
    assert env_bool("FLAG", True) is True
    assert env_int("FLAG", 7) == 7
    assert env_list("FLAG", ["a"]) == ["a"]


def test_a_bad_boolean_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEBUG", "maybe")
    with pytest.raises(SettingError, match="DEBUG='maybe' is not a boolean"):
        env_bool("DEBUG", True)


def test_a_bad_integer_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "eighty")
    with pytest.raises(SettingError, match="PORT='eighty' is not an integer"):
        env_int("PORT", 8000)


def test_an_integer_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "70000")
    with pytest.raises(SettingError, match="PORT=70000 is above the maximum"):
        env_int("PORT", 8000, maximum=65535)


def test_a_value_outside_the_choices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "LOUD")
    with pytest.raises(SettingError, match="LOG_LEVEL='LOUD' is not one of"):
        env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO"))


def test_lists_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOWED_HOSTS", "a.example, b.example,,")
    assert env_list("ALLOWED_HOSTS") == ["a.example", "b.example"]


def test_a_postgres_url_becomes_a_django_database() -> None:
    database = database_from_url("DATABASE_URL",
                                 "postgres://fleet:s%40cret@db.internal:6543/fleet?sslmode=require")
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert (database["NAME"], database["USER"], database["PASSWORD"]) == ("fleet", "fleet",
                                                                          "s@cret")
    assert (database["HOST"], database["PORT"]) == ("db.internal", "6543")
    assert database["OPTIONS"] == {"sslmode": "require"}


def test_sqlite_urls_take_relative_and_absolute_paths() -> None:
    assert database_from_url("D", "sqlite:///data/x.db")["NAME"] == "data/x.db"
    assert database_from_url("D", "sqlite:////var/lib/x.db")["NAME"] == "/var/lib/x.db"


@pytest.mark.parametrize("url", ["mysql://h/db", "postgres://host/", "nonsense"])
def test_an_unusable_database_url_names_the_variable(url: str) -> None:
    with pytest.raises(SettingError, match="DATABASE_URL"):
        database_from_url("DATABASE_URL", url)


@pytest.mark.parametrize("raw", ["models", "/mnt/../etc", "/ok,relative/path"])
def test_an_allow_list_of_paths_takes_only_absolute_paths(monkeypatch: pytest.MonkeyPatch,
                                                          raw: str) -> None:
    monkeypatch.setenv("PATHS", raw)
    with pytest.raises(SettingError, match="PATHS"):
        env_absolute_paths("PATHS")


def test_an_allow_list_of_paths_is_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATHS", "/mnt/models/, /srv//weights")
    assert env_absolute_paths("PATHS") == ["/mnt/models", "/srv/weights"]


def test_labels_are_key_value_pairs_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LABELS", "app=prometheus, team=ops")
    assert env_labels("LABELS") == {"app": "prometheus", "team": "ops"}
    monkeypatch.setenv("LABELS", "app")
    with pytest.raises(SettingError, match="LABELS"):
        env_labels("LABELS")
