"""The size rules of serving/ and controlplane/ (docs/architecture.md, "Size rules"): no
module over 450 lines, no function over 60 lines, none with more than 7 parameters, except
where docs/architecture.md names the exception and says why.

    .venv/bin/python scripts/check_layout.py [--all]   # prints each breach; exit 1 if any

Migrations are left out (generated). `--all` also lists what the exceptions cover.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serving", "controlplane")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7
# In docs/architecture.md, one line per exception: `- exception: <path>[:<function>] — why`.
EXCEPTION = re.compile(r"^- exception: `?([\w/.]+(?::[\w.]+)?)`?\s+(?:—|--|-)\s+\S")


def exceptions() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return {m.group(1) for line in text.splitlines() if (m := EXCEPTION.match(line.strip()))}


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names = [n for n in names if n not in ("self", "cls")]
    return len(names) + (1 if args.vararg else 0) + (1 if args.kwarg else 0)


def breaches() -> list[tuple[str, str]]:
    """(key, message) of every breach; key is `path` or `path:Qualified.name`."""
    found: list[tuple[str, str]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative:
                continue
            source = path.read_text(encoding="utf-8")
            lines = source.count("\n") + (0 if source.endswith("\n") else 1)
            if lines > MAX_MODULE_LINES:
                found.append((relative, f"{relative}: {lines} lines (> {MAX_MODULE_LINES})"))
            tree = ast.parse(source)
            found += _functions(tree, relative, "")
    return found


def _functions(node: ast.AST, relative: str, prefix: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            found += _functions(child, relative, f"{prefix}{child.name}.")
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            key = f"{relative}:{name}"
            length = (child.end_lineno or child.lineno) - child.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((key, f"{key}: {length} lines (> {MAX_FUNCTION_LINES})"))
            count = parameters(child)
            if count > MAX_PARAMETERS:
                found.append((key, f"{key}: {count} parameters (> {MAX_PARAMETERS})"))
            found += _functions(child, relative, f"{name}.")
    return found


def main() -> int:
    allowed = exceptions()
    problems = [message for key, message in breaches() if key not in allowed]
    for message in problems:
        print(message)
    if "--all" in sys.argv:
        for key, message in breaches():
            if key in allowed:
                print(f"(exception) {message}")
    print(f"{len(problems)} breach(es) of the size rules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
