"""Every product file stays under 600 lines and every function under 60, so that a module holds one role and a
function reads in one screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("trainer", "inference", "environments", "rlcommon")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def oversized(source: str, where: str) -> list[str]:
    """What in `source` is over the limits, each as 'where[:line name]: N lines'."""
    found = []
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{where}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{where}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})"
                )
    return found


def test_no_product_file_or_function_is_over_its_limit() -> None:
    files = [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 100  # the packages were found
    found = [f for p in files for f in oversized(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "split these by role:\n" + "\n".join(found)


def test_the_size_check_sees_a_long_function_and_a_long_file() -> None:
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert oversized(long_function, "m.py") == [f"m.py:1 f: {MAX_FUNCTION_LINES + 1} lines (at most 60)"]
    assert oversized("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1), "m.py") == []
    long_file = "x = 1\n" * (MAX_FILE_LINES + 1)
    assert oversized(long_file, "m.py") == [f"m.py: {MAX_FILE_LINES + 1} lines (at most 600)"]
