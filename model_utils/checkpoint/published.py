"""Which folders are published checkpoints and whether one is complete: the rule every reader
shares, train.py's resume and the launcher's requeue alike.

Standard library only (Python 3.8 on a batch host): scripts/launch_plan.py loads this file by
path to decide, before any node starts, whether a requeued run has a checkpoint to resume and
whether a preempted run had already finished. Integrity (checksums) is manifest.py's part.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MARKER = "checkpoint.json"
DCP_METADATA = ".metadata"
TMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step encoded in a published checkpoint's directory name, None for other names."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete checkpoint (one line), or None if it is one."""
    path = Path(path)
    if not path.exists():
        return f"checkpoint {path} does not exist"
    if not path.is_dir():
        return f"checkpoint {path} is not a directory"
    if path.name.startswith(TMP_PREFIX):
        return f"checkpoint {path} is an unfinished save (temporary name)"
    if not (path / DCP_METADATA).is_file():
        inside = complete_checkpoints(path) or complete_checkpoints(path / "checkpoints")
        if inside:  # the checkpoint folder itself (or its run's), given for one checkpoint
            return (
                f"{path} is a folder of checkpoints, not one: give one of them (newest: "
                f"{inside[-1]}), or --resume_from_checkpoint auto with --checkpoint_dir "
                f"{inside[-1].parent}"
            )
        return f"checkpoint {path} has no {DCP_METADATA}: not a DCP checkpoint or not finished"
    if not (path / MARKER).is_file():
        return f"checkpoint {path} has no {MARKER}: the save never completed"
    return None


def is_complete(path: str | Path) -> bool:
    return checkpoint_problem(path) is None


def complete_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Published complete checkpoints in `checkpoint_dir`, oldest step first."""
    return [p for p in step_dirs(checkpoint_dir) if is_complete(p)]


def step_dirs(checkpoint_dir: str | Path) -> list[Path]:
    """Every folder named like a published checkpoint (`step_N`), complete or not, oldest
    first: one missing its `.metadata` or marker is damage an `auto` resume must name."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def finished(checkpoint_dir: str | Path) -> bool:
    """Did the run reach its max_steps? The newest complete checkpoint's marker records its step
    and the run's max_steps: a signal that came too late (or was lost while train.py was
    starting) must not requeue a finished run. An unreadable marker counts as unfinished."""
    newest = latest_checkpoint(checkpoint_dir)
    if newest is None:
        return False
    try:
        meta = json.loads((newest / MARKER).read_text())
        return int(meta["step"]) >= int(meta["run_config"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
