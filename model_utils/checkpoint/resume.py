"""The resume policy and its refusals: which run a checkpoint belongs to (the flags a resume
must keep, and those it may change), what a run may start on (before anything exists), and what
its resume does (after the model and optimizer are built).

`check_before_start(config)` reads only the markers, before any process group, so a refused
resume costs no GPU time: a fresh start must not write over an earlier run's checkpoints; a
resume takes only a checkpoint of this recipe's format and of the same run (model, data,
optimizer format, precision), never one whose saves would replace finished work, never one past
--max_steps, and never on data changed since the save. `resume_or_start(...)` then deletes what
--overwrite_output_dir asked to, picks the checkpoint whose checksums hold, checks it again (an
older one may have been chosen), loads it and puts the schedule's lr in use.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from model_utils import data, optim
from model_utils.checkpoint.manifest import (
    ResumeRefused,
    checkpoint_to_resume,
    complete_checkpoints,
    loadable_marker,
    read_marker,
    step_of,
)
from model_utils.config.arguments import default_warmup
from model_utils.config.flag_spec import Resume
from model_utils.config.run_config import Config, refusal_words, resume_fields, saved_defaults
from model_utils.data.checks import data_check

log = logging.getLogger(__name__)

#: Flags whose resumed value replaces the saved one when given (optim.resume_schedule).
LR_FLAGS = ("lr", "min_lr")

# What a resume may do with each field is declared on the field (config/flag_spec.Resume says
# why each class is treated as it is); every field in none of the sets below is one a resume
# may change (logged as a change).
#: The model's shape, the data stream and the optimizer's stored format: refused on change.
REFUSED_FIELDS = resume_fields(Resume.KEPT)
#: The precision, the recipe, the schedule's shape: refused within the same run.
EXPERIMENT_FIELDS = resume_fields(Resume.EXPERIMENT)
#: The FP8 knobs that change numerics: refused within the same run while FP8 is on in both.
FP8_NUMERICS_FIELDS = resume_fields(Resume.FP8_KNOB)
#: Names this launch rather than the run (or has its own rule): never compared, never reported.
_LAUNCH_FIELDS = resume_fields(Resume.LAUNCH)
#: Recorded fields that are no flag, by the words a refusal uses for them.
_NOT_FLAGS = refusal_words()
#: The value a checkpoint older than a field held.
_SAVED_DEFAULTS = saved_defaults()

#: The way out of every refusal an existing run folder causes: a new run in a folder of its own,
#: named as the user launches (the launcher's RUN_NAME, train.py's --output_dir).
NEW_RUN = (
    "start a new run in another folder (RUN_NAME=NAME with 1.train_llama.sbatch, --output_dir "
    "DIR with train.py)"
)


def _same(saved: Any, current: Any, name: str) -> bool:
    """Equal as the checkpoint stored them (JSON), paths by where they point."""
    current = json.loads(json.dumps(current, default=str))
    if saved == current:
        return True
    if name in ("dataset", "tokenizer") and isinstance(saved, str) and isinstance(current, str):
        return os.path.exists(saved) and os.path.realpath(saved) == os.path.realpath(current)
    return False


def config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], same_run: bool = True
) -> tuple[list, list]:
    """Flags that differ between a checkpoint's run and this one, as ("--name", saved, now):
    (refused: model shape, data stream, optimizer format and precision; allowed: everything
    else, e.g. batch size, sequence length, logging). Fields an older checkpoint did not record
    are not compared, except those with a known value before they existed (--optimizer adamw,
    --master_weights params, untied embeddings). The precision is refused only within
    `same_run` (a resume from the run's own checkpoint_dir): a checkpoint of another run loaded
    into a new folder starts a new run from its weights, in another implementation or precision
    if asked (logged)."""
    if saved:
        saved = {**_SAVED_DEFAULTS, **saved}
    refused, allowed, names = [], [], {}
    kept = set(REFUSED_FIELDS)
    if same_run:
        kept.update(EXPERIMENT_FIELDS)
    if same_run and saved.get("fp8") and current.get("fp8"):
        kept.update(FP8_NUMERICS_FIELDS)
        if saved.get("bf16_cooldown"):  # where its BF16 steps start (one turned on: refused)
            kept.add("max_steps")
            names = {"max_steps": "--max_steps (it places --bf16_cooldown's first BF16 step)"}
    for name in sorted(set(saved) & set(current) - _LAUNCH_FIELDS):
        if name in _NOT_FLAGS and None in (saved[name], current[name]):
            continue  # not measured on one side (a config built without train.validate)
        if _follows_max_steps(name, saved, current):
            continue  # the resumed schedule keeps its saved warm-up: no change to name
        before, now = (_in_effect(name, run) for run in (saved, current))
        if not _same(before, now, name):
            change = (names.get(name) or _NOT_FLAGS.get(name, f"--{name}"), before, now)
            (refused if name in kept and not _moved(name, saved, current) else allowed).append(
                change
            )
    return refused, allowed


def _moved(name: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """The same data or tokenizer at another path (a moved checkout, another mount point): a
    tokenizer whose recorded contents (sha256) are equal, or a local dataset whose saved path
    is gone and whose file or folder name is unchanged, as the saved stream position names it.
    Logged as a change, not refused."""
    before, now = saved[name], current[name]
    if not (isinstance(before, str) and isinstance(now, str)):
        return False
    if name == "tokenizer":
        sums = saved.get("tokenizer_sha256"), current.get("tokenizer_sha256")
        return None not in sums and sums[0] == sums[1]
    if name == "dataset":
        gone = os.path.isabs(before) and not os.path.exists(before)
        return gone and os.path.exists(now) and Path(before).name == Path(now).resolve().name
    return False


def _in_effect(name: str, run: Mapping[str, Any]) -> Any:
    """A flag's value as the run used it: --data_seed unset is --seed (42 given or left to
    the default orders the data alike)."""
    if name == "data_seed" and run.get(name) is None:
        return run.get("seed")
    return run[name]


def _follows_max_steps(name: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """A warm-up that is each side's default for its --max_steps: the change is --max_steps's,
    which a resume may make (the resumed schedule keeps its saved warm-up): none of its own."""
    return name == "warmup" and all(
        run.get("warmup") == default_warmup(int(run.get("max_steps") or 0))
        for run in (saved, current)
    )


def describe_changes(changes: Iterable[tuple[str, Any, Any]]) -> str:
    """`--flag saved -> now`, an empty value as "(none)" (`--bf16_layers  -> 0` read as a typo)."""
    shown = [(flag, *("(none)" if v == "" else v for v in values)) for flag, *values in changes]
    return ", ".join(f"{flag} {saved} -> {now}" for flag, saved, now in shown)


def check_resumable(path: str | Path, current: Mapping[str, Any]) -> list:
    """ResumeRefused (one line listing each difference and what to do) unless the checkpoint at
    `path` is of this recipe's format and was saved by a run of the same model shape and data;
    returns the allowed changes."""
    saved = loadable_marker(path).get("run_config") or {}
    here = current.get("checkpoint_dir")
    same_run = here is None or Path(path).resolve().parent == Path(here).resolve()
    refused, allowed = config_changes(saved, current, same_run)
    if refused:
        fix = NEW_RUN  # from another run's checkpoint, a new folder already: keep the weights
        if not same_run:
            fix = (
                f"to train on from its weights with these, write them out (.venv/bin/python -m "
                f"scripts.convert_checkpoint {path} DIR) and start with --init_from_hf DIR"
            )
        raise ResumeRefused(
            f"checkpoint {path} belongs to another run: {describe_changes(refused)} (saved -> "
            f"this run); resume with the saved values, or {fix}"
        )
    return allowed


def check_fresh_start(checkpoint_dir: str | Path, overwrite: bool) -> None:
    """A run without --resume_from_checkpoint must not write over an earlier run's checkpoints
    (its saves would replace them step by step and its pruning delete the rest)."""
    found = complete_checkpoints(checkpoint_dir)
    if found and not overwrite:
        raise ResumeRefused(
            f"{checkpoint_dir} holds {len(found)} checkpoint(s) of an earlier run (newest: step "
            f"{step_of(found[-1])}): continue it with --resume_from_checkpoint auto, {NEW_RUN}, "
            "or pass --overwrite_output_dir to delete them and start afresh"
        )


def check_resume_target(path: str | Path, checkpoint_dir: str | Path, explicit: bool) -> None:
    """A resume saves into `checkpoint_dir` from the resumed step on, replacing checkpoints of
    the same step and pruning the oldest: refused (ResumeRefused) where that would destroy
    finished work, i.e. another run's checkpoints, or this run's later ones when an explicit
    PATH goes back in time. (`auto` resumes the newest sound one; what lies past it is damaged
    and set aside by the resume.)"""
    found = complete_checkpoints(checkpoint_dir)
    if not found:
        return
    path, newest = Path(path), found[-1]
    if path.resolve().parent != Path(checkpoint_dir).resolve():
        raise ResumeRefused(
            f"{checkpoint_dir} holds {len(found)} checkpoint(s) of its own run (newest: step "
            f"{step_of(newest)}), which a resume from {path} would overwrite and prune: "
            f"{NEW_RUN} to resume from it there, or continue that run with "
            "--resume_from_checkpoint auto"
        )
    step = int(read_marker(path)["step"])
    later = [p for p in found if (step_of(p) or 0) > step]
    if explicit and later:
        raise ResumeRefused(
            f"--resume_from_checkpoint {path} (step {step}) is older than {len(later)} "
            f"checkpoint(s) in {checkpoint_dir} (newest: step {step_of(newest)}), which this run "
            f"would overwrite and prune from step {step + 1} on: continue from the newest with "
            f"--resume_from_checkpoint auto, or move the later ones out of {checkpoint_dir} to "
            f"go back to step {step}"
        )


def check_steps_left(path: str | Path, max_steps: int) -> None:
    """A checkpoint past --max_steps has nothing left to train: resumed, it would be validated
    and saved again, and the run would end as if it had trained. (At exactly --max_steps a
    requeued or resubmitted finished run ends at once, which is what a requeue wants.)"""
    step = int(read_marker(path)["step"])
    if step > max_steps:
        raise ResumeRefused(
            f"checkpoint {path} is at step {step}, past --max_steps {max_steps}: raise "
            f"--max_steps to train on, export it with scripts/convert_checkpoint.py, or {NEW_RUN}"
        )


def check_before_start(config: Config) -> None:
    """ResumeRefused (one line) for a run that would resume another run's checkpoint or write
    over finished work. Reads only; runs before any process group exists."""
    if not config.checkpoint.resume_from_checkpoint:
        check_fresh_start(config.checkpoint.checkpoint_dir, config.checkpoint.overwrite_output_dir)
        return
    path = checkpoint_to_resume(
        config.checkpoint.resume_from_checkpoint, config.checkpoint.checkpoint_dir, verify=False
    )
    default = Path(config.run.output_dir) / "checkpoints"
    elsewhere = default.resolve() != Path(config.checkpoint.checkpoint_dir).resolve()
    if path is None and elsewhere and complete_checkpoints(default):  # --checkpoint_dir added
        raise ResumeRefused(
            f"--resume_from_checkpoint auto: --checkpoint_dir {config.checkpoint.checkpoint_dir} "
            f"holds no checkpoint, but {default} holds this run folder's: give --checkpoint_dir "
            f"{default} to resume from them (or move them), or another --output_dir to start anew"
        )
    if path is not None:
        check_resumable(path, config.as_dict())
        check_same_data(path, config, warn=False)  # the resume warns, once
        explicit = config.checkpoint.resume_from_checkpoint != "auto"
        check_resume_target(path, config.checkpoint.checkpoint_dir, explicit)
        check_steps_left(path, config.run.max_steps)


def check_same_data(path: str | Path, config: Config, warn: bool = True) -> str:
    """A checkpoint's data position means something only in the data it was saved with: a
    local file changed since is refused (one line naming it), or with --allow_data_change a
    warning. Checkpoints from before fingerprints, and hub datasets, have none to compare.
    Returns which check ran, in words (the resume line says it)."""
    saved = (read_marker(path).get("run_config") or {}).get("data_fingerprint")
    change = data.data_change(saved, config.data.data_fingerprint)
    checked = data_check(saved, config.data.data_fingerprint)
    if change is not None and not config.checkpoint.allow_data_change:
        raise ResumeRefused(
            f"checkpoint {path} was saved with other data: {change} in --dataset "
            f"{config.data.dataset} since the save, so its saved position points into other "
            "text; resume on the data it was saved with, or pass --allow_data_change to resume "
            "on this data anyway"
        )
    if change is not None and warn:
        dataset = config.data.dataset
        log.warning("Resuming on changed data (--allow_data_change): %s in %s", change, dataset)
    return checked


def resume_or_start(ckpt: Any, state: Any, scheduler: Any, config: Config) -> Any:
    """Start afresh (deleting the old checkpoints with --overwrite_output_dir) or load the
    newest intact checkpoint under the rules above. Returns the run's flags with the lr values
    in use, which the state then saves."""
    if config.checkpoint.overwrite_output_dir:
        ckpt.remove_all()
    resume = config.checkpoint.resume_from_checkpoint
    path = checkpoint_to_resume(resume, config.checkpoint.checkpoint_dir)  # checksums verified
    if path is None:
        return config
    changed = [c for c in check_resumable(path, config.as_dict()) if c[0][2:] not in LR_FLAGS]
    checked = check_same_data(path, config)  # the checkpoint chosen now, maybe an older one
    ckpt.load(path, state)
    given = {name: config.get(name) for name in LR_FLAGS if name in config.typed}
    try:
        used = optim.resume_schedule(scheduler, given)
    except ValueError as exc:
        raise ResumeRefused(f"resuming from {path}: {exc}") from exc
    log.info("Resumed from %s at step %d (data checked: %s)", path, state.step, checked)
    if changed:
        log.info("Flags changed since the checkpoint: %s", describe_changes(changed))
    for name, value in used.items():
        source = f"--{name} given" if name in given else "saved; not given"
        log.info("Resumed schedule: %s %g (%s)", name, value, source)
    if spent := optim.spent_lr(scheduler, given):
        log.warning(spent)
    config = config.replace(**used)
    state.config = config.as_dict()
    return config
