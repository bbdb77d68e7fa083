"""The suite's free-disk check (helpers.disk): a disk too full for the run is one line before
the first test, not a flood of errors when it fills."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import disk

REPO = Path(__file__).resolve().parents[2]


def _free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / disk.GIB


def test_a_disk_with_room_passes_and_one_without_is_named_with_the_fix(tmp_path: Path) -> None:
    assert disk.shortage({tmp_path: 0.0}, "fix it") is None
    too_much = shutil.disk_usage(tmp_path).total / disk.GIB + 1  # free as others delete: less
    line = disk.shortage({tmp_path / "not-made-yet" / "cache": too_much}, "fix it")
    assert line is not None and "\n" not in line, line
    assert str(tmp_path) in line and f"{too_much:.1f} GiB" in line and line.endswith("fix it")
    assert not (tmp_path / "not-made-yet").exists()


def test_folders_on_one_disk_add_up(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    each = _free_gib(tmp_path) * 0.6
    assert disk.shortage({tmp_path / "a": each}, "fix") is None
    line = disk.shortage({tmp_path / "a": each, tmp_path / "b": each}, "fix")
    assert line is not None and f"{2 * each:.1f} GiB" in line, line


def test_a_whole_tier_run_without_room_stops_before_any_test_in_one_line() -> None:
    # /proc has no free blocks: pytest's temporary root there has no room at all
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": "/proc", "LLAMA_TEST_WARM": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "GiB free on the disk of /proc" in lines[0], lines
    assert "TMPDIR" in lines[0]
