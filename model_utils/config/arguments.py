"""Command-line flags -> the resolved run config (its typed sections, whose fields declare the
flags: sections.py; presets: presets.py; the rules between flags: flag_rules.py).

Flag names follow the upstream FSDP/TE Llama recipe (`--fp8`, `--train_batch_size`,
`--max_context_width`, ...) so its users feel at home. A preset fills every model/data field the
user did not set explicitly; an explicit flag always wins. Bad input raises UsageError, which
train.py prints as one line with exit code 2 before any process group or file is touched.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from model_utils.config import argv, recipes
from model_utils.config.argv import flag_value, precision_name, without_flag
from model_utils.config.flag_spec import Resume, Spec
from model_utils.config.options import TE_IMPLS, TE_RECIPE_OPTIONS
from model_utils.config.presets import PRESET_FIELDS, PRESETS
from model_utils.config.run_config import Config, flag_specs, path_flags
from model_utils.config.sections import SECTIONS
from model_utils.errors import OneLineParser, UsageError


def str2bool(value: str) -> bool:
    """Accept the upstream `--fp8=1` style as well as true/false (config/argv.py's words)."""
    try:
        return argv.str2bool(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says where the default comes from (a
    preset, another flag): "(default: from --preset) (default: None)" told the reader nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text or text.startswith("default"):
            return text
        if isinstance(action.default, bool):  # the switches take 0|1, so show 0|1
            return f"{text} (default: {int(action.default)})"
        return super()._get_help_string(action)


#: A group per config section (config/sections.py), in its order, with its --help title;
#: docs/flags.md's table follows it. None: the run's own fields (Config.recipe, .preset).
_GROUP_TITLES: dict[str | None, str] = {
    None: "the recipe and preset the run starts from",
    "model": "the model's shape",
    "precision": "bf16 or FP8: the implementation and the FP8 recipe's knobs",
    "data": "tokenizer, dataset and batches",
    "optim": "AdamW, master weights and the LR schedule",
    "parallel": "sharding, memory and compilation",
    "checkpoint": "checkpoints, resume, HF import/export",
    "run": "steps, seed, logs, validation, the run folder, dry run, profiling",
}
#: Choices no field can state: the preset table is built on the sections' ModelShape.
_TABLE_CHOICES = {"preset": sorted(PRESETS)}


def _argument(name: str, spec: Spec, kind: type) -> dict[str, Any]:
    """add_argument's keywords for a field's flag: its annotation's type (a bool is a switch
    taking 0|1 or nothing), default, choices, help and metavar."""
    kw: dict[str, Any] = {"default": spec.default, "help": spec.help}
    if kind is bool:
        kw.update(type=str2bool, nargs="?", const=True, metavar="0|1")
    elif kind in (int, float):
        kw["type"] = kind
    choices = spec.choices or _TABLE_CHOICES.get(name)
    if choices:
        kw["choices"] = choices
    if spec.metavar:
        kw["metavar"] = spec.metavar
    return kw


def _flag_type(hint: Any) -> type:
    """`int | None` -> int: the type a flag's value is parsed to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def build_parser() -> argparse.ArgumentParser:
    """The flags, one argparse group per concern (their order is docs/flags.md's table), each
    derived from its config field (config/sections.py)."""
    parser = OneLineParser(
        description="Train Llama or Mistral with FSDP2 in BF16 or FP8 (torchao or TE).",
        formatter_class=_HelpFormatter,
        raises=UsageError,
    )
    specs = flag_specs()
    # (section, the dataclass whose fields are its flags): the run's own, then the sections
    for section, kind in [(None, Config), *SECTIONS.items()]:
        group = parser.add_argument_group(_GROUP_TITLES[section])
        hints = typing.get_type_hints(kind)
        for f in fields(kind):
            if f.name not in specs or not specs[f.name].is_flag:
                continue
            flag_type = _flag_type(hints[f.name])
            group.add_argument(f"--{f.name}", **_argument(f.name, specs[f.name], flag_type))
    return parser


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every preset field the user left unset; explicit flags win."""
    for name in path_flags():
        value = getattr(args, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
        if isinstance(value, str) and ".." in Path(value).parts:
            # `runs/missing/../done` is no path until `missing` exists: a check would find
            # nothing there, then the run would create `missing` and write into `done`.
            setattr(args, name, os.path.realpath(getattr(args, name)))
    preset = PRESETS[args.preset]
    if args.dataset is not None and args.dataset_config_name is None:
        args.dataset_config_name = ""  # the preset's config belongs to the preset's dataset
    for name in PRESET_FIELDS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    args.dataset_config_name = args.dataset_config_name or None
    args.rms_norm_eps = preset.rms_norm_eps
    args.tokenizer_sha256 = None  # what the tokenizer does: train.validate fills it in
    args.data_fingerprint = None  # each local data file's size and ends: train.validate too
    args.rope_scaling = preset.rope_scaling
    args.model_family = preset.model_family
    args.max_position_embeddings = preset.max_position_embeddings or args.max_context_width
    if args.val_batch_size is None:
        args.val_batch_size = args.train_batch_size
    if args.warmup is None:
        args.warmup = default_warmup(args.max_steps)
    precision = precision_name(args.fp8, args.bf16)
    if args.output_dir is None:  # named after the model: --init_from_hf's folder, or the preset
        model = Path(args.init_from_hf).name if args.init_from_hf else ""
        args.output_dir = f"runs/{model or args.preset}-{precision}"
    if args.checkpoint_dir is None:
        args.checkpoint_dir = f"{args.output_dir}/checkpoints"
    return args


def default_warmup(max_steps: int) -> int:
    """10 steps, but at most a tenth of the run: a default must never make a short run invalid
    (`--max_steps 10` with a fixed 10-step warm-up would leave no decay phase)."""
    return max(0, min(10, max_steps // 10))


def section_flags() -> dict[str | None, list[str]]:
    """Each config section's flags (None: the run's own, --recipe and --preset), from the
    parser's groups: a test holds them equal to the sections' fields."""
    parser = build_parser()
    titles = {title: section for section, title in _GROUP_TITLES.items()}
    return {
        titles[group.title]: [action.dest for action in group._group_actions]
        for group in parser._action_groups
        if group.title in titles
    }


def parse_args(argv: list[str] | None = None) -> Config:
    """The one way to a run config: flags, preset, cross-flag rules, then the implementation
    (``auto`` probes TE and the GPU) and the FP8 recipe for its backend."""
    given = expanded(sys.argv[1:] if argv is None else argv, files_only=True)
    args, typed = parse_typed(expanded(given))
    args.recipe = flag_value(given, "recipe")  # the run's record says which recipe it started from
    try:
        return resolve(args, typed)
    except UsageError as exc:
        raise UsageError(recipe_origin(str(exc), given, args.recipe)) from exc


def parse_typed(argv: list[str]) -> tuple[argparse.Namespace, frozenset[str]]:
    """One parse: the flags and which of them were typed (argparse leaves a suppressed default
    out of the namespace, so what it holds was typed; the defaults are filled in after)."""
    parser = build_parser()
    defaults = {action.dest: action.default for action in parser._actions}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    args = parser.parse_args(argv)
    typed = frozenset(vars(args)) - {"help"}
    for name, default in defaults.items():
        if name != "help" and not hasattr(args, name):
            setattr(args, name, default)
    return args, typed


def resolve(args: argparse.Namespace, typed: frozenset[str]) -> Config:
    """The values first (the preset's, --init_from_hf's config.json's, into the parsed flags),
    then the Config, whose typed sections the cross-flag rules read; then the implementation
    and the FP8 recipe for its backend (UsageError for a combination that cannot run)."""
    from model_utils.config import flag_rules, hf_config
    from model_utils.config.machine import has_cuda, resolve_model_impl, why_not_te  # torch

    apply_preset(args)
    if args.init_from_hf:
        try:
            hf_config.apply(args, typed)
        except hf_config.ConfigError as exc:
            raise UsageError(str(exc)) from exc
    config = flag_rules.check_consistency(Config.from_flat(vars(args), typed))
    auto = config.precision.model_impl == "auto"
    config = config.replace(model_impl=resolve_model_impl(config.precision.model_impl))
    try:
        return _checked_impl(config, has_cuda())
    except UsageError as exc:  # a rule of hf the user never chose: say why auto took it
        if auto and config.precision.model_impl == "hf" and "--model_impl hf" in str(exc):
            raise UsageError(f"{exc} (--model_impl auto chose hf: {why_not_te()})") from None
        raise


def _checked_impl(config: Config, cuda: bool) -> Config:
    """The rules that read the resolved --model_impl, then the FP8 recipe for its backend."""
    from model_utils.config import flag_rules, fp8_plan, hf_config

    flag_rules.check_pairings(config, cuda)
    impl = config.precision.model_impl
    rope_type = (config.model.rope_scaling or {}).get("rope_type", "default")
    if impl in TE_IMPLS and rope_type not in hf_config.TE_ROPE_TYPES:
        raise UsageError(
            f"--model_impl {impl} computes RoPE of types {', '.join(hf_config.TE_ROPE_TYPES)}, "
            f"not {rope_type!r} (from --init_from_hf): use --model_impl hf"
        )
    return fp8_plan.resolved(config, cuda)


def recipe_origin(message: str, given: list[str], recipe: str | None) -> str:
    """`message`, with the flags it names that the user did not type but `--recipe` set
    said to come from the recipe: the user typed the recipe's name, not its flags."""
    if not recipe:
        return message
    supplied = explicit_flags(recipes.flags(recipe)) - explicit_flags(without_flag(given, "recipe"))
    named = [f"--{n}" for n in sorted(supplied) if re.search(rf"--{n}\b(?!_)", message)]
    return f"{message} ({', '.join(named)} from --recipe {recipe})" if named else message


def expanded(argv: list[str], files_only: bool = False) -> list[str]:
    """The command line with each `@FILE` (a run folder's run.args) replaced by its arguments
    and, unless `files_only`, each --recipe by its flags (model_utils/config/recipes.py)."""
    try:
        return (recipes.expand_files if files_only else recipes.expand)(argv)
    except recipes.RecipeError as exc:
        raise UsageError(str(exc)) from exc


#: What a run's saved arguments (run.args) leave out: every flag that names this launch rather
#: than the run (Resume.LAUNCH: where it writes, how it starts, what it exports or allows once),
#: which the command that runs the file again says itself. --init_from_hf stays: the weights the
#: run started from.
NOT_SAVED = tuple(
    name
    for name, spec in flag_specs().items()
    if spec.resume is Resume.LAUNCH and spec.is_flag and name != "init_from_hf"
)


def saved_args(config: Config) -> list[str]:
    """The resolved run as train.py arguments, in the parser's order: every flag's value (the
    preset's, the defaults', the resolved implementation and FP8 recipe), so `train.py @FILE`
    trains the same run again whatever comes before the file (the sbatch's defaults); flags
    after it win. Left out at their defaults: the options whose being typed is itself checked
    (a TE recipe knob under torchao, a --preset beside --init_from_hf's config.json)."""
    typed_matters = set(TE_RECIPE_OPTIONS) | (
        {"preset"} if config.checkpoint.init_from_hf else set()
    )
    # --global_batch_size's accumulation is each launch's own (its ranks'), not the run's.
    derived = {"grad_accum_steps"} if config.optim.global_batch_size else set()
    lines = []
    for action in build_parser()._actions:
        name = action.dest
        if name == "help" or name in NOT_SAVED or name in derived:
            continue
        value = config.get(name)
        if value is None or (name in typed_matters and value == action.default):
            continue
        value = int(value) if isinstance(value, bool) else value
        lines.append(f"--{name}={shlex.quote(str(value))}")  # recipes.args_file splits it
    return lines


def explicit_flags(argv: list[str]) -> frozenset[str]:
    """The flags given on a command line (a recipe's included), not filled in by a default or
    a preset (a run's own: Config.typed)."""
    return parse_typed(expanded(argv))[1]
