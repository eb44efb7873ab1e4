"""The side-by-side benchmark checks each control plane's SQLite database after its rounds
and fails where one is damaged."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from bench.gateway_overhead import check_databases
from bench.path_figures import Endpoint
from bench.usage_waits import integrity


def database_with_rows(path: Path) -> Path:
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE record (id INTEGER PRIMARY KEY, body TEXT)")
    connection.executemany("INSERT INTO record (body) VALUES (?)",
                           [("x" * 200,) for _ in range(2000)])
    connection.commit()
    connection.close()
    return path


def damaged(path: Path) -> Path:
    """The file with its third page written over (the table's rows), its header intact."""
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    with open(path, "r+b") as file:
        file.seek(2 * page)
        file.write(b"\xff" * page)
    return path


def test_an_intact_database_checks_ok(tmp_path: Path) -> None:
    assert integrity(database_with_rows(tmp_path / "db.sqlite3")) == "ok"


def test_a_damaged_database_is_told_and_fails_the_run(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    good = database_with_rows(tmp_path / "good.sqlite3")
    bad = damaged(database_with_rows(tmp_path / "bad.sqlite3"))
    assert integrity(bad) != "ok"
    endpoints = [Endpoint("direct", {}, None, {}),
                 Endpoint("gateway", {}, "k", {}, database=good),
                 Endpoint("gateway, 2 workers", {}, "k", {}, database=bad)]
    with pytest.raises(SystemExit, match="damaged database: gateway, 2 workers"):
        check_databases(endpoints)
    shown = capsys.readouterr().out
    assert "gateway ok" in shown and "gateway, 2 workers" in shown


def test_intact_databases_pass_and_a_plane_without_one_is_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = database_with_rows(tmp_path / "good.sqlite3")
    check_databases([Endpoint("gateway", {}, "k", {}, database=good),
                     Endpoint("elsewhere", {}, "k", {}, database=tmp_path / "none.sqlite3")])
    shown = capsys.readouterr().out
    assert "gateway ok" in shown and "elsewhere" not in shown
