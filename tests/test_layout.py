"""Issue 9's size rules for product code: no file over ~500 lines, no function over 60.

Long files and functions are where a reader loses the recipe's thread; a test keeps a later
change from quietly growing them back. KNOWN holds the offenders not split yet: a fix removes
its entry, and nothing may join it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# "path" for a file over the limit, "path:function" for a function (whole def, docstring included).
KNOWN = {
    "te_llama.py",
    "model_utils/checkpoint.py",
    "train.py:train",
    "model_utils/arguments.py:build_parser",
    "model_utils/arguments.py:check_consistency",
    "model_utils/checkpoint.py:load",
}


def product_files() -> list[Path]:
    """The recipe's Python: train.py, te_llama.py, model_utils/ and scripts/."""
    files = [ROOT / "train.py", ROOT / "te_llama.py"]
    for folder in ("model_utils", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def oversized(path: Path) -> list[str]:
    """This file's entries that break a rule, in KNOWN's notation."""
    text = path.read_text()
    name = path.relative_to(ROOT).as_posix()
    found = [name] if len(text.splitlines()) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.name}")
    return found


def offenders() -> set[str]:
    return {entry for path in product_files() for entry in oversized(path)}


def test_no_new_long_files_or_functions() -> None:
    assert sorted(offenders() - KNOWN) == [], "split it: one job per module, small functions"


def test_known_offenders_are_still_offenders() -> None:
    """A split file or function leaves KNOWN, so the list shows what is left to do."""
    assert sorted(KNOWN - offenders()) == []
