"""Docstrings stay at most 15% of the package's lines (issue 26): what, why, the formula and its
source; measurements and their history go to docs/performance.md. Reads the source with ``ast``."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxpar"
MAX_DOCSTRING_SHARE = 0.15
DOCUMENTED = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def docstring_lines(source: str) -> int:
    """Lines of every module, class and function docstring in ``source``."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, DOCUMENTED) and ast.get_docstring(node, clean=False):
            first = node.body[0]
            if isinstance(first, ast.Expr):
                count += first.end_lineno - first.lineno + 1
    return count


def test_docstrings_are_at_most_15_percent_of_the_package():
    total, per_file = 0, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        total += len(source.splitlines())
        per_file[path.relative_to(PACKAGE.parent).as_posix()] = docstring_lines(source)
    share = sum(per_file.values()) / total
    largest = sorted(per_file.items(), key=lambda item: -item[1])[:5]
    assert share <= MAX_DOCSTRING_SHARE, (
        f"docstrings are {share:.1%} of jaxpar's {total} lines (at most {MAX_DOCSTRING_SHARE:.0%}); "
        "the most docstring lines: " + ", ".join(f"{name} ({lines})" for name, lines in largest)
    )


def test_the_readme_is_at_most_200_lines():
    """Issue 26: what jaxpar is, the two commands, concepts, the code map and links; the guides are in docs/."""
    lines = len((PACKAGE.parent / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; move detail to docs/"
