"""Free disk the CPU tier needs, checked before any test starts: a full disk mid-run is a flood
of unrelated errors and ends in pytest's own INTERNALERROR (CI on 2026-12-07, ``No space left
on device`` after 12 minutes), where one line can say what is short and where."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

GIB = 1 << 30

#: Peak of the suite's own folders under the temporary folder: 2.4 GiB in a fresh-clone
#: ``make test`` on 2026-12-07 (df every 2 s; the container tests' build and squash file at
#: the top), rounded up. Passing tests' folders are deleted as they end (pyproject.toml).
TMP_NEED_GIB = 3.0
#: The container tests' cache (Docker data root, Debian root file system, wheels) as a new
#: machine writes it: 5.6 GiB on 2026-12-07. Needed only where it is not there yet.
CONTAINER_CACHE_NEED_GIB = 6.0


def container_cache() -> Path:
    """Where tools/container_e2e.sh keeps its cache (its ``cache_dir``)."""
    if os.environ.get("CONTAINER_CACHE"):
        return Path(os.environ["CONTAINER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-fp8-container"


def _existing(path: Path) -> Path:
    """The path, or its nearest parent that exists (a cache not made yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shortage(needs: dict[Path, float], fix: str) -> str | None:
    """One line naming a file system short of room and how to ``fix`` it, or None when each
    has room for what the folders on it need together (folders on one device add up)."""
    by_device: dict[int, tuple[list[Path], float]] = {}
    for folder, gib in needs.items():
        folder = _existing(folder)
        device = folder.stat().st_dev
        folders, total = by_device.get(device, ([], 0.0))
        by_device[device] = ([*folders, folder], total + gib)
    for folders, gib in by_device.values():
        free = shutil.disk_usage(folders[0]).free / GIB
        if free < gib:
            where = " and ".join(str(f) for f in folders)
            return (
                f"the tests need about {gib:.1f} GiB free on the disk of {where}; "
                f"{free:.1f} GiB is free: free some space or {fix}"
            )
    return None
