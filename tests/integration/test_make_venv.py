"""tools/make_venv.sh, make's install step: the first clone on a machine builds .venv and keeps a
copy in the cache; a later clone copies it, owns its copy, and runs from its own path.

Real venvs and a real pip from this machine's wheels, on a fake checkout whose requirements are
one small package (the real ones take minutes and 2.3 GB per venv).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "make_venv.sh"
#: one small package, and the setuptools that builds the editable install (the venv's own is too
#: old); both pinned to this venv's versions, so their wheels are on this machine
PACKAGES = "".join(
    f"{name}=={importlib.metadata.version(name)}\n" for name in ("iniconfig", "setuptools")
)


def checkout(path: Path, requirements: str = PACKAGES) -> Path:
    """A clone as make_venv.sh sees one: the two requirement files, pyproject, the script."""
    (path / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, path / "tools" / SCRIPT.name)
    (path / "requirements.txt").write_text(requirements)
    (path / "requirements-dev.txt").write_text("# nothing more\n")
    (path / "probe.py").write_text("WHERE = __file__\n")
    (path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "probe"\nversion = "0"\n[tool.setuptools]\npy-modules = ["probe"]\n'
    )
    return path


def make_venv(repo: Path, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV_CACHE": cache}
    python = getattr(sys, "_base_executable", sys.executable)  # what make's python3 would be
    return subprocess.run(
        ["bash", "tools/make_venv.sh", python, ".venv"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run(python: Path, code: str) -> str:
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.strip()


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@dataclass(frozen=True)
class Kept:
    """A cache in which a first clone built and kept its venv, two older venvs beside it."""

    cache: Path
    first: Path
    entry: Path
    built: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Kept:
    root = tmp_path_factory.mktemp("make_venv")
    cache = root / "cache"
    # two venvs kept from earlier requirements, the older used two days ago: it makes way
    for name, age_days in (("older", 2), ("recent", 1)):
        (cache / name).mkdir(parents=True)
        (cache / name / ".complete").touch()
        then = time.time() - age_days * 86400
        os.utime(cache / name / ".complete", (then, then))
    first = checkout(root / "first")
    built = make_venv(first, str(cache))
    assert built.returncode == 0, built.stdout + built.stderr
    (entry,) = (cache / name for name in entries(cache) if name not in ("older", "recent"))
    return Kept(cache, first, entry, built)


def test_the_first_clone_builds_and_keeps_the_requirements_only(kept: Kept) -> None:
    assert "installing the Python environment" in kept.built.stdout
    assert f"kept a copy of this venv in {kept.entry}" in kept.built.stdout
    assert (kept.entry / ".complete").exists()
    assert entries(kept.cache) == sorted([kept.entry.name, "recent"])  # least recently used went
    # the first checkout's editable install is in its venv, not in the copy others start from
    assert list(kept.first.glob(".venv/lib/python3*/site-packages/*probe*"))
    assert not list(kept.entry.glob("lib/python3*/site-packages/*probe*"))


def test_a_later_clone_copies_the_kept_venv_and_owns_its_copy(kept: Kept, tmp_path: Path) -> None:
    second = checkout(tmp_path / "second")
    copied = make_venv(second, str(kept.cache))
    assert copied.returncode == 0, copied.stdout + copied.stderr
    assert f"copying the Python environment to .venv from {kept.entry}" in copied.stdout
    assert "installing" not in copied.stdout
    venv = second / ".venv"
    # its scripts, its packages and its checkout's editable install: this clone's, not the first's
    assert kept.first.as_posix() not in (venv / "bin" / "pip").read_text()
    pip_says = subprocess.run(
        [str(venv / "bin" / "pip"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"from {venv}/lib/" in pip_says, pip_says
    assert run(venv / "bin" / "python", "import probe; print(probe.WHERE)") == str(
        second / "probe.py"
    )
    assert run(venv / "bin" / "python", "import iniconfig; print(iniconfig.__file__)").startswith(
        str(venv)
    )
    assert sorted(p.name for p in second.iterdir() if p.name.startswith(".venv")) == [".venv"]

    # a real copy: editing the clone's venv reaches neither the cache nor the first clone
    (edited,) = venv.glob("lib/python3*/site-packages/iniconfig/__init__.py")
    relative = edited.relative_to(venv)
    edited.write_text(edited.read_text() + "\nEDITED = True\n")
    for other in (kept.entry, kept.first / ".venv"):
        assert "EDITED" not in (other / relative).read_text()


def test_an_empty_venv_cache_builds_from_the_wheels_and_keeps_nothing(
    kept: Kept, tmp_path: Path
) -> None:
    before = entries(kept.cache)
    uncached = make_venv(checkout(tmp_path / "third"), "")
    assert uncached.returncode == 0, uncached.stdout + uncached.stderr
    assert "installing the Python environment" in uncached.stdout
    assert "kept a copy" not in uncached.stdout
    assert entries(kept.cache) == before


def test_a_changed_requirement_builds_anew_and_a_failed_build_keeps_nothing(
    kept: Kept, tmp_path: Path
) -> None:
    before = entries(kept.cache)
    bad = checkout(tmp_path / "bad", requirements="no-such-package-anywhere==1.0\n")
    failed = make_venv(bad, str(kept.cache))
    assert failed.returncode != 0
    assert "installing the Python environment" in failed.stdout  # not the kept venv
    assert "no-such-package-anywhere" in failed.stderr
    assert entries(kept.cache) == before  # nothing kept, no part left behind
