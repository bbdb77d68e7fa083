"""The resume policy in two calls: what a run may start on (before anything exists), and what
its resume does (after the model and optimizer are built).

`check_before_start(config)` reads only: a fresh start must not write over an earlier run's
checkpoints; a resume takes only a checkpoint of the same run (model, data, optimizer format,
precision: compat.py), never one whose saves would replace finished work, never one past
--max_steps, and never on data changed since the save. For the TE implementations,
`check_fp8_state_loadable(config, te_version)` also refuses before the start a checkpoint whose
pickled FP8 state this TE would refuse to load. `resume_or_start(...)` then deletes what
--overwrite_output_dir asked to, picks the checkpoint whose checksums hold, checks it again (an
older one may have been chosen), loads it and puts the schedule's lr in use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from model_utils import data, optim
from model_utils.checkpoint.compat import (
    check_fresh_start,
    check_resumable,
    check_resume_target,
    check_steps_left,
    describe_changes,
)
from model_utils.checkpoint.errors import ResumeRefused, pickled_fp8_state_problem
from model_utils.checkpoint.manifest import read_marker, resolve_checkpoint, resume_candidate
from model_utils.config.sections import CheckpointConfig, Config
from model_utils.errors import UsageError

log = logging.getLogger(__name__)

#: Flags whose resumed value replaces the saved one when given (optim.resume_schedule).
LR_FLAGS = ("lr", "min_lr")


def check_before_start(config: Config) -> None:
    """ResumeRefused (one line) for a run that would resume another run's checkpoint or write
    over finished work. Reads only; runs before any process group exists."""
    if not config.checkpoint.resume_from_checkpoint:
        check_fresh_start(config.checkpoint.checkpoint_dir, config.checkpoint.overwrite_output_dir)
        return
    path = resume_candidate(
        config.checkpoint.resume_from_checkpoint, config.checkpoint.checkpoint_dir
    )
    if path is not None:
        check_resumable(path, config.as_dict())
        check_same_data(path, config, warn=False)  # the resume warns, once
        explicit = config.checkpoint.resume_from_checkpoint != "auto"
        check_resume_target(path, config.checkpoint.checkpoint_dir, explicit)
        check_steps_left(path, config.run.max_steps)


def check_fp8_state_loadable(checkpoint: CheckpointConfig, te_version: str | None) -> None:
    """Refuse, before anything starts, a resume this TE (release ``te_version``) would refuse
    after the model is built: a format-1 checkpoint's pickled FP8 state (UsageError, one line)."""
    resume = checkpoint.resume_from_checkpoint
    path = resolve_checkpoint(resume, checkpoint.checkpoint_dir) if resume else None
    if path is None:
        return
    problem = pickled_fp8_state_problem(path, read_marker(path), te_version, os.environ)
    if problem:
        raise UsageError(problem)


def check_same_data(path: str | Path, config: Config, warn: bool = True) -> None:
    """A checkpoint's data position means something only in the data it was saved with: a
    local file changed since is refused (one line naming it), or with --allow_data_change a
    warning. Checkpoints from before fingerprints, and hub datasets, have none to compare."""
    saved = (read_marker(path).get("run_config") or {}).get("data_fingerprint")
    change = data.data_change(saved, config.data.data_fingerprint)
    if change is None:
        return
    if config.checkpoint.allow_data_change:
        if warn:
            log.warning(
                "Resuming on changed data (--allow_data_change): %s in %s",
                change,
                config.data.dataset,
            )
        return
    raise ResumeRefused(
        f"checkpoint {path} was saved with other data: {change} in --dataset {config.data.dataset} "
        "since the save, so its saved position points into other text; resume on the data it "
        "was saved with, or pass --allow_data_change to resume on this data anyway"
    )


def resume_or_start(
    ckpt: Any, state: Any, scheduler: Any, config: Config, explicit: frozenset
) -> Any:
    """Start afresh (deleting the old checkpoints with --overwrite_output_dir) or load the
    newest intact checkpoint under the rules above. Returns the run's flags with the lr values
    in use, which the state then saves."""
    if config.checkpoint.overwrite_output_dir:
        ckpt.remove_all()
    path = ckpt.resolve_intact(config.checkpoint.resume_from_checkpoint)  # checksums verified
    if path is None:
        return config
    changed = [c for c in check_resumable(path, config.as_dict()) if c[0][2:] not in LR_FLAGS]
    check_same_data(path, config)  # the checkpoint resolve_intact chose, maybe an older one
    ckpt.load(path, state)
    given = {name: config.get(name) for name in LR_FLAGS if name in explicit}
    try:
        used = optim.resume_schedule(scheduler, given)
    except ValueError as exc:
        raise ResumeRefused(f"resuming from {path}: {exc}") from exc
    log.info("Resumed from %s at step %d", path, state.step)
    if changed:
        log.info("Flags changed since the checkpoint: %s", describe_changes(changed))
    for name, value in used.items():
        source = f"--{name} given" if name in given else "saved; not given"
        log.info("Resumed schedule: %s %g (%s)", name, value, source)
    config = config.replace(**used)
    state.config = config.as_dict()
    return config
