"""The rules between flags that argparse cannot express: shapes and combinations; and the
checks each flag's own declaration asks for (its range, a path's name, what it needs and
excludes: config/sections.py). The FP8 rules that read a recipe's row are config/fp8_plan.py's.
Each broken rule is a UsageError, one line.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping

from model_utils.config.options import TRACKERS
from model_utils.config.run_config import Config, flag_specs
from model_utils.errors import UsageError, refuse

#: The longest file or folder name Linux file systems take (NAME_MAX): a longer one raised
#: ENAMETOOLONG from the first `exists()` that looked at it, as a traceback.
MAX_NAME_BYTES = 255


def check_consistency(config: Config) -> Config:
    """Cross-flag rules that argparse cannot express; the config with its trackers' names
    normalised."""
    _check_declared(config)
    _check_shape(config)
    _check_combinations(config)
    _check_observation(config)
    return _checked_trackers(config)


#: --tracker's names -> the package each needs (None: in requirements.txt already).
TRACKER_PACKAGES: dict[str, str | None] = {row.name: row.package for row in TRACKERS}


def tracker_names(spec: str) -> list[str]:
    """``"wandb, MLflow"`` -> ``["wandb", "mlflow"]`` (order kept, repeats dropped); a
    UsageError names an unknown tracker."""
    names: list[str] = []
    for part in spec.split(","):
        name = part.strip().lower()
        if not name or name in names:
            continue
        if name not in TRACKER_PACKAGES:
            raise UsageError(
                f"--tracker: unknown tracker {name!r}; choose from {', '.join(TRACKER_PACKAGES)}"
            )
        names.append(name)
    return names


def check_tracker_packages(names: list[str]) -> None:
    """A UsageError for a tracker whose package is not importable, with the install line."""
    for name in names:
        package = TRACKER_PACKAGES[name]
        if package and importlib.util.find_spec(package) is None:
            raise UsageError(
                f"--tracker {name} needs the {package} package: pip install -e '.[trackers]'"
            )


def check_mlflow_store(env: Mapping[str, str]) -> None:
    """The pinned MLflow (3.x) refuses a file store (MLFLOW_TRACKING_URI=file:... or a path)
    unless MLFLOW_ALLOW_FILE_STORE is true: one line now, not a warning cut short mid-run."""
    uri = env.get("MLFLOW_TRACKING_URI", "")
    path = uri and "://" not in uri and not uri.startswith(("databricks", "sqlite:"))
    allowed = env.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true")
    if (uri.startswith("file:") or path) and not allowed:
        raise UsageError(
            f"--tracker mlflow: MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses:"
            " use sqlite:///PATH/mlflow.db or a server, or set MLFLOW_ALLOW_FILE_STORE=true"
        )


def _checked_trackers(config: Config) -> Config:
    """Known tracker names whose packages are importable (before any process starts), written
    the one way (lower case, no repeats); an MLflow store it will refuse."""
    names = tracker_names(config.run.tracker or "")
    check_tracker_packages(names)
    if "mlflow" in names:
        check_mlflow_store(os.environ)
    return config.replace(tracker=",".join(names))


def profile_window(spec: str) -> tuple[int, int]:
    """``--profile_steps START:END`` -> (START, END), the steps traced (both included); a
    UsageError for any other form."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not match:
        raise UsageError(
            f"--profile_steps takes START:END, the first and last step to trace (e.g. 20:23), "
            f"got {spec!r}"
        )
    start, end = int(match[1]), int(match[2])
    if not 2 <= start <= end:  # torch's profiler warns it is skewed without a warm-up step
        raise UsageError(
            f"--profile_steps {spec}: steps count from 1, the one before START warms the "
            "profiler up (START >= 2), and END must not come before START"
        )
    return start, end


def _check_observation(config: Config) -> None:
    """The profiler's window and the memory snapshot's step lie inside the run."""
    if config.run.profile_steps is not None:
        _, end = profile_window(config.run.profile_steps)
        if end > config.run.max_steps:
            raise UsageError(
                f"--profile_steps {config.run.profile_steps} ends after --max_steps "
                f"{config.run.max_steps}: trace steps the run takes"
            )
    step = config.run.memory_snapshot_step
    if step is not None and not 0 <= step <= config.run.max_steps:
        raise UsageError(
            f"--memory_snapshot_step must be in [0, --max_steps {config.run.max_steps}] (0: at an "
            f"out-of-memory error only), got {step}"
        )


def check_pairings(config: Config, cuda: bool) -> None:
    """What each flag given declares it needs and excludes of the others (config/sections.py),
    once --model_impl is resolved (--cuda_graphs needs te) and with `cuda`: a CUDA GPU here."""
    values = {**config.as_dict(), "cuda": cuda}
    for name, spec in flag_specs().items():
        refuse(spec.pairing_problem(name, values))


def _check_declared(config: Config) -> None:
    """What each flag's field declares: a path or text that is not empty (typically an unset
    shell variable: `--output_dir "$RUN_DIR"` meant the current directory, or for --output_dir
    the file system's root), a name within NAME_MAX (a longer one dies in the first file
    check), a number in its range (NaN passes every comparison: `--lr nan` would train on NaN
    from step 1)."""
    values = config.as_dict()
    # --output_dir first: --checkpoint_dir's default is a folder inside it, and the line must
    # name the flag the user gave.
    for name, spec in sorted(flag_specs().items(), key=lambda item: item[0] != "output_dir"):
        if spec.path or spec.nonempty:
            refuse(value_problem(f"--{name}", values[name], path=spec.path))
        for allowed in spec.ranges:
            refuse(allowed.problem(f"--{name}", values[name], values))


def value_problem(
    flag: str, value: str | None, path: bool = True, required: bool = False
) -> str | None:
    """The line for a given value that is empty or holds a line break or, for a `path`, holds a
    name longer than file systems take (None: fine, or not given). The scripts apply the same
    rule to theirs."""
    if value is None:
        return None
    if not value.strip():
        fix = "give a value" if required else "give a value, or leave the flag out"
        return f"{flag} is empty (an unset shell variable?): {fix}"
    if "\n" in value or "\r" in value:  # run.args keeps a run's flags a line each
        return f"{flag} holds a line break: give a value on one line (rename the folder)"
    for part in value.split("/") if path else ():
        if len(part.encode()) > MAX_NAME_BYTES:
            return (
                f"{flag}: the name '{part[:40]}...' is {len(part.encode())} bytes long; file "
                f"systems take at most {MAX_NAME_BYTES}"
            )
    return None


def _check_shape(config: Config) -> None:
    """Attention heads split the width evenly (and evenly again for RoPE), GQA groups are equal."""
    if config.model.hidden_width % config.model.num_heads:
        raise UsageError(
            f"--hidden_width {config.model.hidden_width} is not divisible by --num_heads "
            f"{config.model.num_heads}"
        )
    if config.model.num_heads % config.model.num_key_value_heads:
        raise UsageError(
            f"--num_heads {config.model.num_heads} is not divisible by "
            f"--num_key_value_heads {config.model.num_key_value_heads} (GQA groups must be equal)"
        )
    head_dim = config.model.hidden_width // config.model.num_heads
    if head_dim % 2:  # RoPE rotates each head's dimensions in pairs
        raise UsageError(
            f"--hidden_width {config.model.hidden_width} / --num_heads {config.model.num_heads} "
            f"gives heads of {head_dim} dimensions; RoPE needs an even number: change either flag"
        )


def _check_combinations(config: Config) -> None:
    """Flags that only make sense together, or never together."""
    if config.optim.min_lr > config.optim.lr:
        raise UsageError(f"--min_lr {config.optim.min_lr} is larger than --lr {config.optim.lr}")
    if config.optim.warmup >= config.run.max_steps and config.optim.lr_decay_style != "constant":
        raise UsageError(
            f"--warmup {config.optim.warmup} leaves no decay phase before --max_steps "
            f"{config.run.max_steps}; lower --warmup or use --lr_decay_style constant"
        )
    if config.precision.bf16_layers:
        _check_bf16_layers(config)
    if config.precision.bf16_cooldown and config.run.max_steps < 2:  # no FP8 step before it
        raise UsageError("--bf16_cooldown needs --max_steps >= 2: FP8 steps, then BF16 ones")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if config.parallel.sharding_strategy == "none" and world_size > 1:
        raise UsageError(
            f"--sharding_strategy none runs one process without FSDP2, but this launch has "
            f"{world_size} ranks: use --sharding_strategy full, or launch one process "
            "(NPROC_PER_NODE=1 with 1.train_llama.sbatch)"
        )


def _check_bf16_layers(config: Config) -> None:
    """Indices of existing layers, and not every one (with a bf16 lm_head nothing is FP8: a
    BF16 run recorded as FP8)."""
    layers, given = config.model.num_layers, config.precision.bf16_layers
    for item in given.split(","):
        try:
            index = int(item)
        except ValueError:
            index = None
        if index is None or not -config.model.num_layers <= index < config.model.num_layers:
            raise UsageError(
                f"--bf16_layers {config.precision.bf16_layers}: {item!r} is not a layer of this "
                f"{config.model.num_layers}-layer model (give indices from "
                f"{-config.model.num_layers} to "
                f"{config.model.num_layers - 1}, comma-separated, e.g. 0,-1)"
            )
    if (
        len({int(i) % layers for i in given.split(",")}) == layers
        and not config.precision.fp8_lm_head
    ):
        raise UsageError(
            f"--bf16_layers {given} keeps all {layers} decoder layers (and the lm_head) in bf16: "
            "nothing would train in FP8; train with --fp8=0"
        )
