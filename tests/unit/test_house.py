"""The house rules a newcomer relies on (issue 9), checked on every `make test`.

Files and functions small enough to read in one sitting, the formatter owning layout, the
package never reaching up into the repo root, and the README's map of the tree matching the
tree. Each rule names the offenders so a failure says what to split or fix.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def product_files() -> list[Path]:
    """The code a user runs: the recipe, the model, the package and the scripts."""
    files = [ROOT / "train.py", ROOT / "te_llama.py"]
    for folder in ("model_utils", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def python_files() -> list[Path]:
    skip = {".venv", "runs", ".git"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    return found


def test_product_files_stay_readable_in_one_sitting():
    too_long = [
        f"{p.relative_to(ROOT)} ({n})"
        for p in product_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, f"split these files (over {MAX_FILE_LINES} lines): {too_long}"


def test_no_product_function_over_sixty_lines():
    found = [line for p in product_files() for line in long_functions(p)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_formatter_owns_layout():
    marker = "# fmt: " + "skip"  # spelled in two parts so this file does not match itself
    skipped = [str(p.relative_to(ROOT)) for p in python_files() if marker in p.read_text()]
    assert not skipped, f"'{marker}' in {skipped}: let ruff format own the layout"


def test_package_never_imports_the_repo_root():
    """model_utils is the library; train.py and te_llama.py are built on it, not under it."""
    root_modules = {p.stem for p in ROOT.glob("*.py")}
    upward = []
    for path in sorted((ROOT / "model_utils").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            upward += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in root_modules]
    assert not upward, f"model_utils imports root modules: {upward}"


def test_readme_map_matches_the_package():
    """Every module of model_utils is on README's map ("How it is built"), by file name or, in a
    sub-package, by its stem; and every file the map names exists."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How it is built", 1)[1].split("\n## ", 1)[0]
    package_block = section.split("model_utils/", 1)[1].split("\nscripts/", 1)[0]
    words = set(re.findall(r"[\w/]+(?:\.py)?", package_block))
    modules = [
        p.relative_to(ROOT / "model_utils")
        for p in (ROOT / "model_utils").rglob("*.py")
        if p.name != "__init__.py"
    ]
    missing = sorted(
        str(m)
        for m in modules
        if m.name not in words and not (len(m.parts) > 1 and m.stem in words)
    )
    assert not missing, f"README's 'How it is built' omits {missing}"
    names = {m.name for m in modules} | {str(m) for m in modules}
    ghosts = sorted(w for w in words if w.endswith(".py") and w not in names)
    assert not ghosts, f"README's 'How it is built' names files that do not exist: {ghosts}"
