"""The TE test double: a pure-PyTorch stand-in for the Transformer Engine API the project uses.

``site/`` holds a ``transformer_engine`` package (the double) and ``reference.py`` the math it
computes with. Nothing in the product imports this; tests put it on the import path:

* in-process: the ``te_double`` fixture (tests/conftest.py) calls
  :func:`install` / :func:`uninstall`, which put a finder for ``transformer_engine`` first on
  ``sys.meta_path`` (its submodules follow the package's own path) and purge
  ``transformer_engine*`` from ``sys.modules`` afterwards;
* subprocesses (``train.py --model_impl te`` under torchrun): pass :func:`subprocess_env`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

SITE_DIR = Path(__file__).resolve().parent / "site"
TESTS_DIR = Path(__file__).resolve().parent.parent


def pythonpath_entries() -> list[str]:
    """Paths that make ``import transformer_engine`` resolve to the double."""
    return [str(SITE_DIR), str(TESTS_DIR)]


def subprocess_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) whose PYTHONPATH puts the double first."""
    env = dict(os.environ if base is None else base)
    parts = pythonpath_entries() + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def _purge() -> None:
    for name in list(sys.modules):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            del sys.modules[name]


class _DoubleFinder(importlib.abc.MetaPathFinder):
    """Finds the top-level ``transformer_engine`` in ``site/``, before any installed TE."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "transformer_engine":
            return None  # submodules: found through the double package's own __path__
        return importlib.machinery.PathFinder.find_spec(name, [str(SITE_DIR)])


_FINDER = _DoubleFinder()


def install() -> None:
    """Make ``import transformer_engine`` load the double in this process."""
    _purge()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undo :func:`install` (the double's modules and its finder)."""
    _purge()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
