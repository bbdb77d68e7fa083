"""Never lose a run, round 3 (issue 33), on real files in one process: locks that cover every
folder a run writes, checkpoints verified or refused, damage set aside and named, data that
changed under a resume. The same behaviour through train.py's processes is in
tests/integration/test_run_integrity_processes.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model_utils import run_lock  # noqa: E402

# ============================================================================================
# 1. A live run's lock covers every folder below it, and a folder holding it


def _holder_in_another_process(directory: Path) -> subprocess.Popen:
    """A process that holds `directory`'s run lock until its stdin closes."""
    code = (
        "import sys; from model_utils import run_lock; run_lock.RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_inside_or_around_a_live_run_is_refused_naming_the_holder(tmp_path: Path):
    live = tmp_path / "runs" / "a"
    holder = _holder_in_another_process(live)
    try:
        inside = live / "checkpoints"  # another run's --checkpoint_dir in this run's default one
        with pytest.raises(run_lock.RunLocked) as refused:
            run_lock.check_not_locked(run_lock.lock_dirs(str(tmp_path / "b"), str(inside)).values())
        line = str(refused.value)
        assert (
            f"{inside} is inside {live}, which is in use by another run (pid {holder.pid} " in line
        )
        assert "\n" not in line
        with pytest.raises(run_lock.RunLocked, match=f"{tmp_path / 'runs'} holds {live}, which"):
            run_lock.check_not_locked([tmp_path / "runs"])  # a run folder around the live one
        run_lock.check_not_locked([tmp_path / "b", tmp_path / "runs" / "b"])  # beside it: fine
        assert not inside.exists()  # the check created nothing
    finally:
        holder.stdin.close()
        holder.wait()
    run_lock.check_not_locked([inside, tmp_path / "runs"])  # a dead holder blocks nothing


def test_the_lock_taken_after_start_up_also_covers_overlaps(tmp_path: Path) -> None:
    """validate() only looks; a run that took a folder around this one's in between is still
    refused when rank 0 takes its locks, and leaves no folder of its own behind."""
    import torch
    import torch.distributed as dist

    from model_utils import distributed
    from model_utils.arguments import parse_args

    live = tmp_path / "a"
    holder = _holder_in_another_process(live)
    ours = tmp_path / "b"
    args = parse_args(["--preset", "tiny", f"--output_dir={ours}", f"--checkpoint_dir={live}/c"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(run_lock.RunLocked, match=f"{live}/c is inside {live}, which is in"):
            run_lock.hold_run_dirs(args, distributed.world_from_env({}), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        holder.stdin.close()
        holder.wait()
    assert not ours.exists() and not (live / "c").exists()  # no folder holding only .run.lock


def test_a_released_lock_leaves_no_folder_that_holds_only_the_lock(tmp_path: Path) -> None:
    refused = run_lock.RunLock(tmp_path / "new" / "run").acquire()
    refused.release()  # nothing written: the folders acquire made are gone
    assert not (tmp_path / "new").exists()
    kept = run_lock.RunLock(tmp_path / "used").acquire()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    kept.release()  # a folder holding the run's work keeps it (and the lock file)
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == [
        run_lock.LOCK_NAME,
        "metrics.jsonl",
    ]
    existing = tmp_path / "mine"
    existing.mkdir()
    run_lock.RunLock(existing).acquire().release()  # the user's own empty folder stays
    assert existing.is_dir() and not any(existing.iterdir())


def test_train_refuses_a_checkpoint_dir_inside_a_live_runs_folder(
    tmp_path: Path, refused_by_train
) -> None:
    live = tmp_path / "a"
    holder = _holder_in_another_process(live)
    try:
        _, [line], stderr = refused_by_train(
            "--preset", "tiny", f"--output_dir={tmp_path / 'b'}", f"--checkpoint_dir={live}/c"
        )
    finally:
        holder.stdin.close()
        holder.wait()
    assert f"is inside {live}, which is in use by another run (pid {holder.pid} " in line
    assert "Traceback" not in stderr and not (tmp_path / "b").exists()
