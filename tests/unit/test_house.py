"""The house rules a newcomer relies on, checked on every `make test`.

Rooms that hold together: a package offers a few names, a module borrows few from its
siblings, files stay under a generous size (a line cap alone splits files at line counts, not
at seams), product prose says what and why rather than history. Functions small enough to
read in one sitting, the formatter owning layout, the
package never reaching up into the repo root, no import circle and no import from a later stage
of the pipeline, the README's map of the tree matching the tree, the README staying a short
user's guide, and every relative link in the docs resolving; the same rules over analysis/ as
over model_utils/, and all non-test code under one line budget. Each rule names the offenders so
a failure says what to split or fix; the limits and measures are tests/helpers/house.py's, and a
run that includes this file ends with each rule's headroom (tests/conftest.py).
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from helpers.house import (
    MAX_FILE_LINES,
    MAX_FUNCTION_LINES,
    MAX_NON_TEST_LINES,
    MAX_PACKAGE_API,
    MAX_SIBLING_NAMES,
    PACKAGES,
    ROOT,
    api_counts,
    function_lengths,
    lines_of,
    non_test_files,
    product_files,
    room_lines,
    sibling_counts,
)

#: Rooms over a cohesion limit today, pinned at their count so they can only shrink (none now).
OVER_THE_LIMIT: dict[str, int] = {}


def python_files() -> list[Path]:
    skip = {".venv", "runs", ".git"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def long_functions(path: Path) -> list[str]:
    return [f"{where} ({n})" for n, where in function_lengths(path) if n > MAX_FUNCTION_LINES]


def test_product_files_stay_readable_in_one_sitting():
    too_long = [
        f"{p.relative_to(ROOT)} ({n})"
        for p in product_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, f"split these files (over {MAX_FILE_LINES} lines): {too_long}"


def over_limit(counts: dict[str, int], limit: int) -> list[str]:
    """The rooms over `limit` beyond their pinned count, and pins a shrunk room no longer needs."""
    found = []
    for room, count in counts.items():
        pinned = OVER_THE_LIMIT.get(room, limit)
        if count > pinned:
            found.append(f"{room} ({count} > {pinned})")
        elif room in OVER_THE_LIMIT and count < pinned:
            found.append(f"{room}: now {count}, lower its OVER_THE_LIMIT pin")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_offers_a_few_names(package: str):
    found = over_limit(api_counts(package), MAX_PACKAGE_API)
    assert not found, f"packages offering over {MAX_PACKAGE_API} names: {found}"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_module_borrows_few_names_from_its_siblings(package: str):
    found = over_limit(sibling_counts(package), MAX_SIBLING_NAMES)
    assert not found, f"modules importing over {MAX_SIBLING_NAMES} sibling names: {found}"


def test_non_test_code_stays_under_its_line_budget():
    """All non-test code (helpers.house.NON_TEST_CODE), not one package: lines moved out of a
    room count where they land. At the cap, split a room at a seam or delete, do not squeeze."""
    counts = {path: lines_of(path) for path in non_test_files()}
    total = sum(counts.values())
    rooms = sorted(room_lines(counts).items(), key=lambda item: -item[1])[:3]
    assert total <= MAX_NON_TEST_LINES, (
        f"non-test code has {total:,} lines, over its budget of {MAX_NON_TEST_LINES:,}; "
        f"the biggest rooms: {rooms}"
    )


def test_the_line_budget_counts_every_kind_of_non_test_code():
    """Guards against a glob that silently matches nothing: each kind is counted, tests not."""
    names = {p.relative_to(ROOT).as_posix() for p in non_test_files()}
    kinds = ("train.py", "analysis/compare_runs.py", "tools/slurm_cluster.sh", "Makefile")
    assert set(kinds) | {"1.train_llama.sbatch", "0.transformer-engine.dockerfile"} <= names
    assert not any(name.startswith("tests/") for name in names)


#: History in product prose: what a module did once, the story of a failure, a date. Those go
#: to docs/failures.md and benchmarks/results/; the code says what it does and why.
HISTORY = re.compile(
    r"(?<!is )(?<!are )(?<!be )(?<!was )\bused to \w+"
    r"|\bincidents?\b"
    r"|\b20\d\d-[01]\d-[0-3]\d\b",
    re.IGNORECASE,
)


def code_prose(path: Path) -> Iterable[tuple[int, str]]:
    """(line, text) of every docstring and comment in a Python file."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                yield value.lineno, value.value
    for number, line in enumerate(source.splitlines(), 1):
        if "#" in line:
            yield number, line[line.index("#") :]


def history_in(paths: Iterable[Path]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{line}: {m.group(0)!r}"
        for p in paths
        for line, text in code_prose(p)
        for m in HISTORY.finditer(" ".join(text.split()))
    ]


def test_product_prose_says_what_and_why_not_history():
    found = history_in(product_files())
    assert not found, f"history in docstrings/comments (move it to docs/): {found}"


def test_the_history_check_sees_a_story_and_spares_a_purpose(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    story = tmp_path / "story.py"
    story.write_text(
        '''"""Loads a file.\n\nThe resume used to save twice (2026-11-20)."""\n# an incident\n'''
    )
    purpose = tmp_path / "purpose.py"
    purpose.write_text(
        '''"""The tokenizer is used to build windows."""\nx = 1  # the key is used to sort\n'''
    )
    assert len(history_in([story])) == 3
    assert history_in([purpose]) == []


def test_no_product_function_over_sixty_lines():
    found = [line for p in product_files() for line in long_functions(p)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_formatter_owns_layout():
    marker = "# fmt: " + "skip"  # spelled in two parts so this file does not match itself
    skipped = [str(p.relative_to(ROOT)) for p in python_files() if marker in p.read_text()]
    assert not skipped, f"'{marker}' in {skipped}: let ruff format own the layout"


#: What each package must not import: what is built on it. model_utils is the library; the
#: analysis of runs (analysis/), the commands (scripts/), the developer tools (tools/), the
#: benchmarks and the root's train.py and te_llama.py are built on it, not under it. analysis/
#: imports what it must of model_utils and none of the commands built on both (scripts/ runs
#: its environment check by path, not as an import).
BUILT_ON = {
    "model_utils": ("analysis", "scripts", "tools", "benchmarks"),
    "analysis": ("scripts", "tools", "benchmarks"),
}


def imported_tops(path: Path) -> set[str]:
    """The top-level names a Python file imports (absolute imports; inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_built_on_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os.path\n\ndef f():\n    from analysis.parity import judge\n")
    assert imported_tops(module) == {"os", "analysis"}


@pytest.mark.parametrize("package", PACKAGES)
def test_package_never_imports_what_is_built_on_it(package: str):
    above = {p.stem for p in ROOT.glob("*.py")} | set(BUILT_ON[package])
    upward = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(imported_tops(path) & above)
    ]
    assert not upward, f"{package} imports what is built on it: {upward}"


def readme_map() -> str:
    """The README's map of the code: its "## Map of the code" section."""
    readme = (ROOT / "README.md").read_text()
    assert "## Map of the code" in readme, "README.md lost its '## Map of the code' section"
    return readme.split("## Map of the code", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_readme_map_matches_the_package(package: str):
    """Every module of the package is on README's map ("Map of the code"), by file name or, in a
    sub-package, by its stem; and every file the map names exists."""
    first, *lines = readme_map().split(f"\n{package}/", 1)[1].splitlines()
    package_block = "\n".join([first, *itertools.takewhile(lambda line: line[:1] == " ", lines)])
    words = set(re.findall(r"[\w/]+(?:\.py)?", package_block))
    modules = [
        p.relative_to(ROOT / package)
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    ]
    missing = sorted(
        str(m)
        for m in modules
        if m.name not in words and not (len(m.parts) > 1 and m.stem in words)
    )
    assert not missing, f"README's 'Map of the code' omits {missing}"
    names = {m.name for m in modules} | {str(m) for m in modules}
    ghosts = sorted(w for w in words if w.endswith(".py") and w not in names)
    assert not ghosts, f"README's 'Map of the code' names files that do not exist: {ghosts}"


def test_readme_map_names_only_files_that_exist():
    """Outside the package block too: every top-level entry of the map is a file or folder."""
    block = readme_map().split("```")[1].splitlines()
    entries = [line.split()[0] for line in block if line[:1].strip()]
    ghosts = [e for e in entries if not (ROOT / e).exists()]
    assert entries and not ghosts, f"README's map names what does not exist: {ghosts}"


#: The README is a user's guide (issue 32): measurements, design and reference live in docs/.
MAX_README_LINES = 250

#: Links to pages another change is writing; each is checked like any link once it exists.
PENDING_PAGES: set[str] = set()


def test_readme_stays_a_short_users_guide():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move measurements to "
        "benchmarks/results/ and design or reference to docs/, and link them"
    )


def markdown_pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "data" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return pages + sorted((ROOT / "benchmarks").rglob("*.md"))


def prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    return "\n".join(
        part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if not i % 2
    )


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        name = f"{page.relative_to(ROOT)}: {target}"
        if not file.exists():
            if str(file.relative_to(ROOT)) not in PENDING_PAGES:
                broken.append(f"{name} (no such file)")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{name} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    """README.md, docs/, benchmarks/ and data/README.md: each relative link names a file that
    exists, and its #anchor a heading of that page."""
    broken = [b for page in markdown_pages() for b in broken_links(page)]
    assert not broken, f"broken links: {broken}"


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Two words\n\n```\n# not a heading\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    good = "[a](page.md#two-words) [b](#a-page) [c](https://x.org/#nothing)"
    bad = "[d](gone.md) [e](page.md#not-a-heading) [f](#three)"
    page.write_text(page.read_text() + good + "\n" + bad + "\n")
    assert broken_links(page) == [
        "page.md: gone.md (no such file)",
        "page.md: page.md#not-a-heading (no such heading)",
        "page.md: #three (no such heading)",
    ]


# Every documented command runs as written: tests/unit/test_doc_commands.py.


@pytest.mark.parametrize(
    "folder, script",
    [  # every command of scripts/ and analysis/ that needs torch or the recipe
        (path.parent.name, path.stem)
        for folder in ("scripts", "analysis")
        for path in sorted((ROOT / folder).glob("*.py"))
        if '__name__ == "__main__"' in (text := path.read_text())
        and re.search(r"^(from|import) (torch|model_utils|analysis)\b", text, re.M)
    ],
)
def test_a_script_run_by_path_without_the_environment_says_so_in_one_line(folder, script):
    """`python3 scripts/X.py` with a Python that lacks torch (here: site-packages off, -S) says
    so in one line (scripts/environment_check.py) instead of a ModuleNotFoundError traceback."""
    done = subprocess.run(
        [sys.executable, "-S", str(ROOT / folder / f"{script}.py"), "a", "b"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT.parent,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"{script}.py: error: {sys.executable} has no module 'torch': run .venv/bin/python -m "
        f"{folder}.{script} (the environment make creates)\n"
    )


def test_ctrl_c_while_a_script_loads_torch_is_one_line(tmp_path):
    """Ctrl-C in the first seconds of `python -m scripts.convert_checkpoint` was a 30-line
    traceback of torch's import (here: a torch whose import is interrupted)."""
    (tmp_path / "torch.py").write_text("raise KeyboardInterrupt\n")
    done = subprocess.run(
        [sys.executable, "-m", "scripts.convert_checkpoint", "a", "b"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert (done.returncode, done.stderr) == (
        130,
        "convert_checkpoint.py: error: interrupted while loading\n",
    )


def package_modules(package: str) -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file: for `from a.b import c`, a.b.c
    if it is a module, else a.b, and every package on the way (their __init__ runs first)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in filter(None, map(known, targets)):
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in own_packages}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_between_the_packages_modules(package: str):
    modules = package_modules(package)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import circles (function-level imports included): " + "; ".join(
        " <-> ".join(group) for group in cycles
    )


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


# ============================================================================================
# Stages: the package's folders are pipeline stages, and no module imports one of a later stage
# (issue 32), counting imports inside functions too. Order and reasons: docs/architecture.md.

#: The stages in pipeline order. `errors` is a leaf (model_utils/errors.py); `parallel` is the
#: foundation, as torchtitan's distributed/: world, device, process group, canonical parameter
#: names, mesh, FSDP. model_utils/__init__.py is no stage.
STAGES = (
    "errors",
    "config",
    "parallel",
    "precision",
    "data",
    "model",
    "optim",
    "checkpoint",
    "run",
    "report",
)


#: The analysis package's stages in order: the profiler traces read back, the parity verdict on
#: loss curves, the comparison's picture (parity's band), the profiled step's breakdown (traces),
#: the comparison's run in the trackers (parity's gap and band), then the comparison built on all
#: of them, and the projection of a measured pair to N nodes. analysis/__init__.py is no stage.
ANALYSIS_STAGES = (
    "traces",
    "parity",
    "compare_plot",
    "step_breakdown",
    "compare_trackers",
    "compare_runs",
    "project_scale",
)
#: Each package under the house rules and its stages' order.
STAGES_OF = {"model_utils": STAGES, "analysis": ANALYSIS_STAGES}


def stage_of(module: str) -> str:
    """`<package>.<stage>...` -> `<stage>`; "" for the package itself."""
    return module.split(".")[1] if "." in module else ""


def unstaged_modules(modules: Iterable[str], stages: tuple[str, ...] = STAGES) -> list[str]:
    return sorted(m for m in modules if "." in m and stage_of(m) not in stages)


def later_stage_imports(graph: dict[str, set[str]], stages: tuple[str, ...] = STAGES) -> list[str]:
    """Each import of a later stage's module, as `module -> module (stage -> stage)`."""
    order = {stage: i for i, stage in enumerate(stages)}
    found = []
    for name in sorted(graph):
        for other in sorted(graph[name]):
            mine, theirs = order.get(stage_of(name)), order.get(stage_of(other))
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{name} -> {other} ({stage_of(name)} -> {stage_of(other)})")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_from_a_later_stage(package: str):
    modules, stages = package_modules(package), STAGES_OF[package]
    unstaged = unstaged_modules(modules, stages)
    assert not unstaged, (
        f"modules in no stage: {unstaged}: add their stage to {package}'s order (STAGES_OF) in "
        "tests/unit/test_house.py at its place in the order (and to docs/architecture.md)"
    )
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    upward = later_stage_imports(graph, stages)
    assert not upward, (
        f"imports from a later stage (order: {' < '.join(stages)}; function-level imports "
        "included): " + "; ".join(upward)
    )


def test_the_stage_check_sees_an_upward_import_and_an_unknown_package():
    graph = {
        "model_utils": {"model_utils.run.b"},
        "model_utils.errors": set(),
        "model_utils.config.a": {"model_utils.errors", "model_utils.run.b"},
        "model_utils.run.b": {"model_utils.config.a", "model_utils.run"},
        "model_utils.run": set(),
    }
    assert later_stage_imports(graph) == [
        "model_utils.config.a -> model_utils.run.b (config -> run)"
    ]
    assert unstaged_modules([*graph, "model_utils.extra", "model_utils.extra.c"]) == [
        "model_utils.extra",
        "model_utils.extra.c",
    ]


def test_nothing_edits_the_import_path():
    """The recipe is installable (`pip install -e .`, make does it) and scripts and benchmarks
    run as modules from the repository root; the TE double is found by a meta-path finder."""
    edits = []
    for folder in ("model_utils", "analysis", "scripts", "tools", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if re.search(r"sys\.path\.(insert|append)\(|sys\.path\[:0\]", line):
                    edits.append(f"{path.relative_to(ROOT)}:{number}")
    assert not edits, f"sys.path edited in {edits}"


def test_tests_share_helpers_not_each_other():
    """Shared test code lives in tests/helpers; a test module imports no other test module,
    and only the benchmarks' own tests (test_benchmarks.py) import a benchmark."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top, last = name.split(".")[0], name.split(".")[-1]
                if last.startswith("test_") or (
                    top == "benchmarks" and path.name != "test_benchmarks.py"
                ):
                    found.append(f"{path.relative_to(ROOT)}: {name}")
    assert not found, f"move what these share into tests/helpers: {found}"
