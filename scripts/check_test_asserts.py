#!/usr/bin/env python3
"""Fail on a test that cannot fail: every ``test_*`` function under tests/ must assert something.

Tests are the ``test_*`` functions and methods in ``test_*.py`` files (fixtures excepted). A test
asserts when its body holds an ``assert``, a ``raise AssertionError``, a ``pytest.raises``/``warns``/
``fail``, or a call to a helper that asserts: one whose name says so (``assert_*``, ``check_*``,
``expect_*``), or a function or method defined anywhere in the tests tree that itself asserts by these
rules (resolved transitively, by name). Offenders are printed as file:line and the script exits 1.
Standard library only (no torch), so ``make test`` runs it first, in about a second.

    python scripts/check_test_asserts.py [paths ...]   # default: tests/
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PYTEST_ASSERTING = {"raises", "warns", "fail", "deprecated_call"}
ASSERTING_PREFIXES = ("assert_", "check_", "expect_")


def _called_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _direct_facts(fn: ast.AST) -> tuple[bool, set[str]]:
    """(whether ``fn`` asserts by itself, the names it calls)."""
    asserts, calls = False, set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            asserts = True
        elif isinstance(node, ast.Raise) and node.exc is not None and "AssertionError" in ast.unparse(node.exc):
            asserts = True
        elif isinstance(node, ast.Call):
            name = _called_name(node)
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "pytest"
                and func.attr in PYTEST_ASSERTING
            ):
                asserts = True
            elif name.startswith(ASSERTING_PREFIXES):
                asserts = True
            elif name:
                calls.add(name)
    return asserts, calls


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _is_fixture(fn: ast.AST) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def find_offenders(files: list[Path]) -> list[str]:
    """``file:line: name`` of every test function that asserts nothing, directly or through a helper."""
    parsed = [(path, ast.parse(path.read_text(), filename=str(path))) for path in files]
    facts: dict[str, list[tuple[bool, set[str]]]] = {}  # helper name -> facts of each definition
    for _, tree in parsed:
        for fn in _functions(tree):
            facts.setdefault(fn.name, []).append(_direct_facts(fn))

    asserting: set[str] = {name for name, defs in facts.items() if any(a for a, _ in defs)}
    changed = True
    while changed:  # a helper asserts if it calls one that does (any definition of that name)
        changed = False
        for name, defs in facts.items():
            if name not in asserting and any(calls & asserting for _, calls in defs):
                asserting.add(name)
                changed = True

    offenders = []
    for path, tree in parsed:
        if not path.name.startswith("test_"):
            continue
        for fn in _functions(tree):
            if not fn.name.startswith("test_") or _is_fixture(fn):
                continue
            direct, calls = _direct_facts(fn)
            if not direct and not calls & asserting:
                offenders.append(
                    f"{path}:{fn.lineno}: {fn.name} asserts nothing (no assert, pytest.raises or asserting helper)"
                )
    return offenders


def test_files(paths: list[Path]) -> list[Path]:
    found = []
    for path in paths:
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path(__file__).resolve().parent.parent / "tests"]
    offenders = find_offenders(test_files(roots))
    for line in offenders:
        print(line)
    if offenders:
        print(f"{len(offenders)} test(s) cannot fail: give each an assert", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
