"""train.py's command-line grammar, read the way argparse reads it: boolean words, a flag's
value, a switch's state, and a run's precision name.

One definition for both readers of an argument list: train.py's parser (config/arguments.py)
and the launcher (scripts/launch_plan.py), which plans a run folder from the same arguments
before any torch is installed. Standard library only, and Python 3.8 on a batch host.
"""

from __future__ import annotations

from collections.abc import Sequence

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
#: The flags naming files or folders (their Spec says `path`): what is written, then what is
#: read. The launcher reads relative ones from the folder it was started in, not the checkout.
OUTPUT_PATH_FLAGS = ("output_dir", "checkpoint_dir", "export_hf")
INPUT_PATH_FLAGS = ("dataset", "tokenizer", "init_from_hf", "resume_from_checkpoint")


def str2bool(value: str) -> bool:
    """The upstream `--fp8=1` style as well as true/false (ValueError for anything else)."""
    lowered = str(value).strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(f"expected 0/1 or true/false, got {value!r}")


def precision_name(fp8: bool, bf16: bool) -> str:
    """fp8, bf16 or fp32: how run folders, run records, the ready line and compare_runs' labels
    name a run's precision."""
    return "fp8" if fp8 else ("bf16" if bf16 else "fp32")


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of --NAME (`--NAME V` or `--NAME=V`); the last one wins, as in argparse."""
    value = None
    for i, arg in enumerate(args):
        if arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def switch_value(args: Sequence[str], name: str, default: bool = False) -> bool:
    """Is the switch --NAME on? As argparse reads a switch (nargs='?'): `--NAME`, `--NAME 0`,
    `--NAME=false`; the last one wins; `default` when absent. A value train.py will refuse
    counts as on (the parser then says so)."""
    on = default
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


def precision_of(args: Sequence[str]) -> str:
    """The precision name of a (recipe-expanded) argument list, as train.py resolves it:
    --fp8 on is fp8; otherwise --bf16 (on by default) decides between bf16 and fp32."""
    return precision_name(switch_value(args, "fp8"), switch_value(args, "bf16", default=True))
