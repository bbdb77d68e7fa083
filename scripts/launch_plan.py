"""train.py's arguments as 1.train_llama.sbatch builds them (`launcher.py plan`): the script's
defaults, the run folder and `--resume_from_checkpoint auto` where the user did not decide
otherwise, the folders in effect, what a requeue must not repeat, and whether to train at all
(--help, --validate_only). Standard library only, like launcher.py.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType


class UsageError(Exception):
    """A setting the user must change: one line, exit 2."""


def _recipes() -> ModuleType:
    """model_utils/config/recipes.py, loaded from its file: it is standard-library Python, and
    importing the model_utils package from here would need the repository on sys.path."""
    path = Path(__file__).resolve().parents[1] / "model_utils" / "config" / "recipes.py"
    spec = importlib.util.spec_from_file_location("llama_recipes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_recipes(args: Sequence[str]) -> list[str]:
    """`args` with each --recipe expanded, as train.py expands it (UsageError if unknown)."""
    recipes = _recipes()
    try:
        return recipes.expand(args)
    except recipes.RecipeError as exc:
        raise UsageError(str(exc)) from exc


def precision(args: Sequence[str]) -> str:
    """fp8, bf16 or fp32, as train.py names a run's precision (its default --output_dir)."""
    args = with_recipes(args)
    if switch_value(args, "fp8"):
        return "fp8"
    mentioned = any(a == "--bf16" or a.startswith("--bf16=") for a in args)
    return "bf16" if not mentioned or switch_value(args, "bf16") else "fp32"


def run_folder(run_dir: str, args: Sequence[str], named: bool) -> str:
    """The run folder: a RUN_NAME is taken as given; a job name (or `local`) gets the precision
    appended unless it ends with it, so `--fp8=1` and `--fp8=0` of one command are two runs (the
    second used to resume the first one's checkpoints and re-label them)."""
    if named:
        return run_dir
    suffix = f"-{precision(args)}"
    return run_dir if run_dir.endswith(suffix) else run_dir + suffix


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of --NAME in train.py's arguments (--NAME V or --NAME=V); the last one wins, as
    in argparse."""
    value = None
    for i, arg in enumerate(args):
        if arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


#: train.py's flags that this launcher reads: an abbreviation of one (argparse takes --output
#: for --output_dir) would get past it, and e.g. split the run between two folders.
READ_FLAGS = (
    "output_dir",
    "checkpoint_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "validate_only",
    "help",
)
FALSE_WORDS = ("0", "false", "no", "off")  # train.py's str2bool


def check_spelled_out(args: Sequence[str]) -> None:
    """UsageError for an abbreviation of a flag in READ_FLAGS, before anything is created."""
    for arg in args:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        matches = [
            f"--{full}" for full in READ_FLAGS if name and full != name and full.startswith(name)
        ]
        if matches:
            raise UsageError(
                f"--{name}: write {' or '.join(matches)} in full (the launcher reads it and "
                "would miss an abbreviation)"
            )


def switch_value(args: Sequence[str], name: str) -> bool:
    """Is train.py's switch --NAME on? As argparse reads it (nargs='?'): `--NAME`, `--NAME 0`,
    `--NAME=false`; the last one wins. A value train.py will refuse counts as on."""
    on = False
    for i, arg in enumerate(args):
        if arg == f"--{name}":
            following = args[i + 1] if i + 1 < len(args) else "-"
            on = following.startswith("-") or following.strip().lower() not in FALSE_WORDS
        elif arg.startswith(f"--{name}="):
            on = arg.split("=", 1)[1].strip().lower() not in FALSE_WORDS
    return on


def without_flag(args: Sequence[str], name: str, optional_value: bool = False) -> list[str]:
    """`args` without --NAME and its value (`--NAME V`, `--NAME=V`; with `optional_value`, a
    switch's value is dropped only when it is one, as argparse would take it)."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            if not (optional_value and arg.startswith("-")):
                continue
        if arg == f"--{name}":
            skip_value = True
        elif not arg.startswith(f"--{name}="):
            kept.append(arg)
    return kept


def for_requeue(
    args: Sequence[str], restart: int, checkpoint_dir: str, saved: bool
) -> tuple[list[str], str]:
    """The user's arguments for restart number `restart` of a job, and a log line if changed.

    A requeued job re-runs its first arguments, but its checkpoints are now its own progress:
    --overwrite_output_dir would delete them, and an explicit --resume_from_checkpoint PATH
    would go back to PATH and redo (and overwrite) the steps since. Both go, and the run
    resumes from its own newest checkpoint. A PATH stays while the run has `saved` nothing
    yet: without it the restart would train from scratch."""
    dropped = []
    if switch_value(args, "overwrite_output_dir"):
        dropped.append("--overwrite_output_dir")
        args = without_flag(args, "overwrite_output_dir", optional_value=True)
    path = flag_value(args, "resume_from_checkpoint")
    if saved and path not in (None, "auto"):
        dropped.append(f"--resume_from_checkpoint {path}")
        args = without_flag(args, "resume_from_checkpoint")
    if not dropped:
        return list(args), ""
    note = (
        f"restart {restart}: without {' and '.join(dropped)} (for the first start only): "
        f"resuming from the newest checkpoint in {checkpoint_dir}"
        + ("" if saved else " (none yet: a fresh start)")
    )
    return list(args), note


def train_arguments(defaults: Sequence[str], run_dir: str, args: Sequence[str]) -> list[str]:
    """train.py's arguments: the script's defaults, the launcher's run folder and resume, then
    the user's (argparse: the last one wins). The launcher's own flags are left out where the
    user decided: --output_dir (the checkpoints follow it, as train.py's default does), and
    `--resume_from_checkpoint auto` with their own resume or --overwrite_output_dir (which
    train.py refuses together)."""
    own = [] if flag_value(args, "output_dir") is not None else ["--output_dir", run_dir]
    if flag_value(args, "init_from_hf") is not None:
        defaults = without_flag(defaults, "preset")  # the model is the checkpoint's config.json
    if flag_value(args, "resume_from_checkpoint") is None and not switch_value(
        args, "overwrite_output_dir"
    ):
        own += ["--resume_from_checkpoint", "auto"]
    return [*defaults, *own, *args]


def run_folders(train_args: Sequence[str]) -> tuple[str, str]:
    """(checkpoint folder, run folder) train.py will use, absolute as it resolves them (from
    the repository): --checkpoint_dir defaults to <output_dir>/checkpoints."""
    out = os.path.expanduser(flag_value(train_args, "output_dir") or "")
    ckpt = os.path.expanduser(flag_value(train_args, "checkpoint_dir") or "")
    ckpt = ckpt or os.path.join(out, "checkpoints")
    return os.path.abspath(ckpt), os.path.abspath(out)


def launch_mode(args: Sequence[str]) -> str:
    """'help' (-h/--help), 'validate' (--validate_only) or 'train': the first two are answered
    by the launcher's one argument check, with no torchrun and no run folder."""
    if any(arg in ("-h", "--help") for arg in args):
        return "help"
    return "validate" if switch_value(args, "validate_only") else "train"


def has_checkpoint(checkpoint_dir: str) -> bool:
    """Does the folder hold a published checkpoint (step_N/checkpoint.json)?"""
    return any(Path(checkpoint_dir).glob("step_*/checkpoint.json"))


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm has requeued this job (0 outside a job: a stray variable means nothing)."""
    restart = env.get("SLURM_RESTART_COUNT", "") if env.get("SLURM_JOB_ID") else ""
    return int(restart) if restart.isdigit() else 0


def plan(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`plan RUN_DIR N DEFAULTS... ARGS...` as bash assignments (quoted for eval): train_args,
    checkpoint_dir, output_dir, mode, note."""
    run_dir, count, rest = argv[0], int(argv[1]), list(argv[2:])
    defaults, args = rest[:count], rest[count:]
    check_spelled_out(args)
    run_dir = run_folder(run_dir, [*defaults, *args], named=bool(env.get("RUN_NAME")))
    checkpoint_dir, output_dir = run_folders(train_arguments(defaults, run_dir, args))
    note, restart = "", restart_count(env)
    if restart > 0:
        saved = has_checkpoint(checkpoint_dir)
        args, note = for_requeue(args, restart, checkpoint_dir, saved)
    values = {
        "checkpoint_dir": checkpoint_dir,
        "output_dir": output_dir,
        "mode": launch_mode(args),
        "note": note,
    }
    train_args = " ".join(map(shlex.quote, train_arguments(defaults, run_dir, args)))
    lines = [f"train_args=({train_args})"]
    lines += [f"{name}={shlex.quote(value)}" for name, value in values.items()]
    return "\n".join(lines)
