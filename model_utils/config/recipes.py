"""Named A/B recipes: `--recipe llama3-8b-fp8` and its twin `--recipe llama3-8b-bf16`.

A recipe is a list of train.py flags, expanded where `--recipe` stands on the command line (as
argparse's @file would be): flags before it (1.train_llama.sbatch's defaults) are overridden by
it, flags after it override it. The fp8 and bf16 recipes of a model are built from one list of
shared flags, so the twins differ in the precision flags alone: the A/B is fair by construction.

Standard library only: 1.train_llama.sbatch's launcher reads recipes too (for the run folder's
precision), on whatever Python the batch host has.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Sequence

# One node of 8xH100, full depth. The settings are the fastest measured per layer on one H100
# (benchmarks/results/): delayed scaling, --compile, micro-batch 4 with the MLPs recomputed
# (what fits 32 layers at seq 8192 by the per-layer activation arithmetic, not measured at full
# depth). Schedule: torchtitan's Llama 3 8B defaults (lr 3e-4, 200 warm-up steps, 1000 steps).
_SCHEDULE = (
    "--lr=3e-4",
    "--min_lr=3e-5",
    "--warmup=200",
    "--max_steps=1000",
    "--validation_freq=100",
    "--checkpoint_freq=200",
)
_H100_NODE = (
    "--model_impl=te",
    "--activation_checkpointing=1",
    "--ac_scope=mlp",
    "--compile=1",
    *_SCHEDULE,
)
# One H100, a whole Llama 3.2 (tied embeddings, 16 or 28 layers at seq 8192). The 1B holds
# micro-batch 4 without recomputation; the 3B's fp32 parameters, gradients and moments take
# ~51 GB alone, so it recomputes its MLPs, at micro-batch 2 (59 GiB, and faster than 1: both
# measured, docs/recipes.md). Same schedule as the node recipes.
_ONE_H100 = ("--model_impl=te", "--compile=1", *_SCHEDULE)
_SHARED: dict[str, tuple[str, ...]] = {
    "llama3-8b": ("--preset=llama3-8b", "--train_batch_size=4", *_H100_NODE),
    "llama2-7b": ("--preset=llama2-7b", "--train_batch_size=6", *_H100_NODE),
    "llama3.2-1b": ("--preset=llama3.2-1b", "--train_batch_size=4", *_ONE_H100),
    "llama3.2-3b": (
        "--preset=llama3.2-3b",
        "--train_batch_size=2",
        "--activation_checkpointing=1",
        "--ac_scope=mlp",
        *_ONE_H100,
    ),
    # One node of 8xH100: the 3B's states shard 8 ways, so micro-batch 4 without recomputation.
    "llama3.2-3b-node": ("--preset=llama3.2-3b", "--train_batch_size=4", *_ONE_H100),
    # The local try: the tiny preset on CPU (emulated FP8 via torchao), a minute per run.
    "tiny": ("--preset=tiny", "--max_steps=50", "--validation_freq=25"),
}
#: What each side of an A/B adds to the shared flags; nothing else differs.
PRECISIONS: dict[str, tuple[str, ...]] = {"fp8": ("--fp8=1",), "bf16": ("--fp8=0",)}
_DELAYED_ON_TE = ("--fp8_recipe=delayed",)


class RecipeError(ValueError):
    """An unknown recipe or a --recipe without a name: one line, exit 2."""


def names() -> list[str]:
    return [f"{model}-{precision}" for model in _SHARED for precision in PRECISIONS]


def flags(name: str) -> list[str]:
    """The flags of recipe `name` (`<model>-fp8` or `<model>-bf16`)."""
    model, _, precision = name.rpartition("-")
    if model not in _SHARED or precision not in PRECISIONS:
        raise RecipeError(f"--recipe {name}: no such recipe; choose one of {', '.join(names())}")
    shared = list(_SHARED[model])
    extra = PRECISIONS[precision]
    if precision == "fp8" and "--model_impl=te" in shared:
        extra = (*extra, *_DELAYED_ON_TE)
    return [*shared, *extra]


def _words(line: str, where: str) -> list[str]:
    """One line of an `@FILE` as a shell splits it: quotes keep spaces, a `#` starting a word
    starts a comment; RecipeError for a line that does not split (an unclosed quote)."""
    try:
        for comment in re.finditer(r"(?<!\S)#", line):  # the first one outside quotes
            with contextlib.suppress(ValueError):
                return shlex.split(line[: comment.start()])
        return shlex.split(line)
    except ValueError as exc:
        raise RecipeError(f"{where}: {str(exc).lower()}: {line}") from None


def args_file(path: str) -> list[str]:
    """The arguments of an `@FILE`, line by line (`--flag=value` or `--flag value`, a value
    with spaces or `#` quoted): blank and `#` lines skipped."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        words = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecipeError(f"@{path}: cannot read the arguments file ({words})") from None
    return [word for n, line in enumerate(lines, 1) for word in _words(line, f"@{path} line {n}")]


def expand_files(argv: Sequence[str], within: tuple[str, ...] = ()) -> list[str]:
    """`argv` with each `@FILE` replaced in place by the arguments in FILE (which may name
    other files, never one it is read from: `within`)."""
    out: list[str] = []
    for arg in argv:
        if not (arg.startswith("@") and len(arg) > 1):
            out.append(arg)
            continue
        real = os.path.realpath(os.path.expanduser(arg[1:]))
        if real in within:
            chain = " -> ".join(f"@{path}" for path in (*within, real))
            raise RecipeError(f"{arg}: an arguments file names itself ({chain}); remove the line")
        out += expand_files(args_file(arg[1:]), (*within, real))
    return out


def expand(argv: Sequence[str]) -> list[str]:
    """`argv` with each `--recipe NAME` (or `--recipe=NAME`) replaced in place by its flags,
    and each `@FILE` by its arguments (args_file: a run folder's run.args); later ones win."""
    out: list[str] = []
    args = iter(expand_files(argv))
    for arg in args:
        if arg == "--recipe":
            name = next(args, "-")  # none, or the next flag: no name
            if name.startswith("-"):
                raise RecipeError(f"--recipe needs a name: one of {', '.join(names())}")
            out += flags(name)
        elif arg.startswith("--recipe="):
            out += flags(arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out
