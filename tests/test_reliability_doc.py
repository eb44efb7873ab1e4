"""docs/reliability.md names, for each failure mode, the test that proves it: every test it
names must exist, so the page cannot outlive a renamed or deleted test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"


def named_tests() -> list[tuple[str, str]]:
    """(file, test) for every `file::test` on the page; `::test` alone means the file named
    last before it."""
    named: list[tuple[str, str]] = []
    current = ""
    for match in re.finditer(r"`((?:tests/[\w/]+\.py)?)::(test_\w+)(?:\[[^\]]*\])?`",
                             DOC.read_text()):
        current = match.group(1) or current
        named.append((current, match.group(2)))
    return named


def defined(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_the_reliability_page_names_exists() -> None:
    named = named_tests()
    assert len(named) >= 20, "the page names too few tests: has its notation changed?"
    missing = [f"{path}::{name}" for path, name in named
               if not path or not (ROOT / path).exists() or name not in defined(path)]
    assert missing == []
