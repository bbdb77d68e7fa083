"""Command-line flags -> the resolved run config (its typed sections: sections.py; presets:
presets.py; the rules between flags: flag_rules.py).

Flag names follow the upstream FSDP/TE Llama recipe (`--fp8`, `--train_batch_size`,
`--max_context_width`, ...) so its users feel at home. A preset fills every model/data field the
user did not set explicitly; an explicit flag always wins. Bad input raises UsageError, which
train.py prints as one line with exit code 2 before any process group or file is touched.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from model_utils.config import argv
from model_utils.config.argv import precision_name
from model_utils.config.options import (  # noqa: F401 (re-exported: the flags' choices)
    AC_SCOPES,
    FP8_ATTENTION_RECIPES,
    MASTER_WEIGHTS,
    MODEL_IMPLS,
    OPTIMIZERS,
    PATH_FLAGS,
    RESHARD_POLICIES,
    TE_IMPLS,
    TE_RECIPES,
    TORCHAO_RECIPES,
)
from model_utils.config.presets import PRESET_FIELDS, PRESETS
from model_utils.config.sections import Config
from model_utils.errors import UsageError, first_line, os_error_words  # noqa: F401 (re-exported)


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


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block on error; a training log wants one actionable line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _recipe_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag(
        "recipe",
        default=None,
        help="a named A/B recipe (e.g. llama3-8b-fp8 and its twin llama3-8b-bf16): its flags "
        "take this place on the command line; later flags override them",
    )
    flag("preset", default="tiny", choices=sorted(PRESETS), help="model shape and data defaults")


def _model_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    m = "model shape (default: from --preset)"
    flag("hidden_width", type=int, help=m)
    flag("num_layers", type=int, help=m)
    flag("num_heads", type=int, help=m)
    flag("num_key_value_heads", type=int, help=m + "; < num_heads gives GQA")
    flag("intermediate_size", type=int, help=m)
    flag("vocab_size", type=int, help=m + "; must be >= the tokenizer's size")
    flag(
        "max_context_width",
        type=int,
        help="sequence length of every packed window (default: from --preset)",
    )
    flag("rope_theta", type=float, help="RoPE base (default: from --preset)")
    flag(
        "tie_word_embeddings",
        type=str2bool,
        nargs="?",
        const=True,
        default=None,
        metavar="0|1",
        help="one matrix for the input embedding and lm_head, trained as one parameter "
        "(Llama 3.2 1B/3B; default: from --preset or --init_from_hf's config.json)",
    )


def _precision_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag(
        "model_impl",
        default="auto",
        choices=MODEL_IMPLS,
        help="te: TE TransformerLayer; te_linear: HF with te.Linear; hf: stock HF; "
        "auto: te when TE and an FP8-capable GPU are present, else hf",
    )
    switch("fp8", False, "train the linear layers in FP8")
    switch("bf16", True, "compute in bf16 (fp32 master weights); 0 = fp32 compute")
    flag(
        "fp8_recipe",
        default=None,
        help=f"torchao: {'|'.join(TORCHAO_RECIPES)} (default tensorwise); "
        f"TE: {'|'.join(TE_RECIPES)} (default delayed)",
    )
    flag("fp8_format", default="hybrid", choices=("hybrid", "e4m3"), help="TE FP8 format")
    flag(
        "amax_history_len",
        type=int,
        default=1024,
        help="TE delayed scaling history (rows: one per forward, plus one per recomputed layer "
        "under whole-layer AC)",
    )
    flag("amax_compute_algo", default="max", choices=("max", "most_recent"), help="TE delayed")
    flag("fp8_margin", type=int, default=0, help="TE scaling margin (powers of 2)")
    switch(
        "fp8_weights",
        False,
        "TE: keep weights in FP8 only (fp8_model_init); trains with --master_weights optimizer",
    )
    switch(
        "fp8_attention",
        False,
        "TE (--model_impl te): attention in FP8 too (cuDNN; recipe fp8_dpa); delayed on Hopper",
    )
    switch("fp8_all_gather", False, "torchao tensorwise: FSDP2 all-gathers weights in float8")


def _data_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag("tokenizer", help="HF tokenizer: hub name or local path (default: from --preset)")
    flag("dataset", help="HF dataset hub name (streamed) or local file/folder")
    flag("dataset_config_name", help="HF dataset config, e.g. 'en' for allenai/c4")
    flag("text_column", default="text", help="column holding the document text")
    flag("train_batch_size", type=int, help="micro-batch per device (sequences)")
    flag("val_batch_size", type=int, default=None, help="default: --train_batch_size")


def _optim_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag("grad_accum_steps", type=int, default=1, help="micro-batches per optimizer step")
    flag("lr", type=float, default=1e-3, help="peak learning rate")
    flag("min_lr", type=float, default=1e-4, help="learning rate at max_steps")
    flag(
        "warmup",
        type=int,
        default=None,
        help="linear warm-up steps (default: max_steps // 10, at most 10)",
    )
    flag(
        "lr_decay_style",
        default="cosine",
        choices=("cosine", "linear", "constant"),
        help="decay from --lr to --min_lr after warm-up",
    )
    flag(
        "optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        help="adamw: fp32 moments (8 bytes/param); adamw8bit, adamw_fp8: torchao's AdamW with "
        "8-bit / FP8 moments (~2 bytes/param)",
    )
    flag(
        "master_weights",
        default="params",
        choices=MASTER_WEIGHTS,
        help="params: fp32 parameters, cast to bf16 for compute; optimizer: bf16 parameters, "
        "fp32 master copies in AdamW (TE's FusedAdam on CUDA with TE)",
    )
    flag("weight_decay", type=float, default=0.1, help="AdamW decay (not on norms/biases)")
    flag("beta1", type=float, default=0.9, help="AdamW first-moment decay")
    flag("beta2", type=float, default=0.95, help="AdamW second-moment decay")
    flag("grad_clip", type=float, default=1.0, help="max global grad norm; 0 disables")


def _run_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag("max_steps", type=int, default=100, help="optimizer steps")
    flag("seed", type=int, default=42, help="model init, data order and RNG streams")
    flag("logging_freq", type=int, default=1, help="steps between log lines")
    flag("validation_freq", type=int, default=0, help="steps between validations; 0 = end only")
    flag("validation_batches", type=int, default=4, help="held-out batches per validation")
    flag("output_dir", default=None, help="run directory (default runs/<preset>-<precision>)")
    switch("tensorboard", False, "TensorBoard scalars in <output_dir>/tensorboard (rank 0)")
    switch(
        "validate_only",
        False,
        "check flags, data, tokenizer and checkpoint, then exit: 0 ready, 2 bad input "
        "(the launcher runs this once before torchrun)",
    )
    flag(
        "profile_steps",
        default=None,
        metavar="START:END",
        help="torch.profiler traces of steps START..END (inclusive; one warm-up step before), "
        "on every rank: <output_dir>/profile/step_START/rank_R.pt.trace.json.gz; read them "
        "with `python -m scripts.step_breakdown RUN...` (default: off)",
    )
    flag(
        "memory_snapshot_step",
        type=int,
        default=None,
        metavar="N",
        help="CUDA only: record the caching allocator's history and dump a snapshot after step "
        "N and at an out-of-memory error (0: at an OOM only) to <output_dir>/memory/; open it "
        "at https://pytorch.org/memory_viz (default: off)",
    )
    flag(
        "slow_rank_threshold",
        type=float,
        default=1.5,
        metavar="RATIO",
        help="at report steps, a W line names the rank (and node) whose busy time per step is "
        "more than RATIO x the ranks' median (docs/hangs.md); 0 = off",
    )
    flag(
        "hang_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="no step done for SECONDS: every rank writes its Python stacks to "
        "<output_dir>/hang/ and exits (docs/hangs.md); default 20x the measured step time, at "
        "least 300 s; 0 = off",
    )
    flag(
        "tracker",
        default="",
        metavar="NAME[,NAME]",
        help="experiment trackers fed from rank 0 at report steps: wandb, mlflow, tensorboard "
        "(tensorboard = --tensorboard); a resume continues the same tracker runs; see "
        "docs/trackers.md (default: none)",
    )


def _parallel_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag(
        "sharding_strategy",
        default="full",
        choices=("full", "hybrid"),
        help="full: FSDP2 over all ranks; hybrid: shard in a node, replicate across",
    )
    flag(
        "reshard_after_forward",
        default="default",
        choices=RESHARD_POLICIES,
        help="FSDP2: default = all but the last layer and [norm, lm_head] (torchtitan); never = "
        "keep gathered for backward (no second gather and cast, more memory); always",
    )
    switch("activation_checkpointing", False, "recompute decoder layers in backward")
    flag("ac_every", type=int, default=1, help="with AC: recompute every Nth layer (2 = half)")
    flag(
        "ac_scope",
        default="layer",
        choices=AC_SCOPES,
        help="with AC: `layer` recomputes whole layers; `mlp` only their MLPs (on --model_impl te "
        "TE's LayerNormMLP recompute, TE >= 2.11, which skips fc2)",
    )
    switch("compile", False, "torch.compile each decoder layer")
    switch("chunked_loss", True, "lm_head + cross-entropy by chunks, no full logits; 0 = HF's")
    flag("dist_timeout", type=int, default=600, help="seconds before a stuck collective fails")


def _checkpoint_flags(flag: Callable[..., None], switch: Callable[..., None]) -> None:
    flag("checkpoint_dir", default=None, help="default <output_dir>/checkpoints")
    flag(
        "checkpoint_freq",
        type=int,
        default=0,
        help="steps between checkpoints; 0 = at the end only; -1 = none (a preemption "
        "signal still saves)",
    )
    flag("keep_last", type=int, default=2, help="checkpoints kept; 0 keeps all")
    switch("async_checkpoint", False, "write checkpoints in the background")
    flag("resume_from_checkpoint", default=None, help="PATH or 'auto' (newest in checkpoint_dir)")
    switch(
        "overwrite_output_dir",
        False,
        "start afresh where an earlier run left checkpoints: they are deleted at start-up "
        "(without it such a run is refused)",
    )
    switch(
        "allow_data_change",
        False,
        "resume although a local --dataset file changed since the checkpoint was saved (its "
        "saved position then points into other text; without it such a resume is refused)",
    )
    flag("init_from_hf", default=None, help="start from a Hugging Face Llama checkpoint dir")
    flag("export_hf", default=None, help="write the final model as HF safetensors to this dir")


#: (section, title, flags): a group per config section (config/sections.py), in its order;
#: docs/flags.md's table follows it. None: the run's own fields (Config.recipe, .preset).
_FLAG_GROUPS = (
    (None, "the recipe and preset the run starts from", _recipe_flags),
    ("model", "the model's shape", _model_flags),
    ("precision", "bf16 or FP8: the implementation and the FP8 recipe's knobs", _precision_flags),
    ("data", "tokenizer, dataset and batches", _data_flags),
    ("optim", "AdamW, master weights and the LR schedule", _optim_flags),
    ("parallel", "sharding, memory and compilation", _parallel_flags),
    ("checkpoint", "checkpoints, resume, HF import/export", _checkpoint_flags),
    ("run", "steps, seed, logs, validation, the run folder, dry run, profiling", _run_flags),
)


def build_parser() -> argparse.ArgumentParser:
    """The flags, one argparse group per concern (their order is docs/flags.md's table)."""
    parser = _OneLineParser(
        description="Train Llama with FSDP2 in BF16 or FP8 (torchao or Transformer Engine).",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # `--output /x` must not quietly mean --output_dir
    )
    for _, title, add_flags in _FLAG_GROUPS:
        group = parser.add_argument_group(title)

        def flag(name: str, group=group, **kw: Any) -> None:
            group.add_argument(f"--{name}", **kw)

        def switch(name: str, default: bool, help: str, group=group) -> None:
            group.add_argument(
                f"--{name}",
                type=str2bool,
                nargs="?",
                const=True,
                default=default,
                metavar="0|1",
                help=help,
            )

        add_flags(flag, switch)
    return parser


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every preset field the user left unset; explicit flags win."""
    for name in PATH_FLAGS:
        value = getattr(args, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
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
    args.max_position_embeddings = preset.max_position_embeddings or args.max_context_width
    if args.val_batch_size is None:
        args.val_batch_size = args.train_batch_size
    if args.warmup is None:
        args.warmup = default_warmup(args.max_steps)
    precision = precision_name(args.fp8, args.bf16)
    if args.output_dir is None:
        args.output_dir = f"runs/{args.preset}-{precision}"
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
    titles = {title: section for section, title, _ in _FLAG_GROUPS}
    return {
        titles[group.title]: [action.dest for action in group._group_actions]
        for group in parser._action_groups
        if group.title in titles
    }


def parse_args(argv: list[str] | None = None) -> Config:
    """The one way to a run config: flags, preset, cross-flag rules, then the implementation
    (``auto`` probes TE and the GPU) and the FP8 recipe for its backend."""
    from model_utils.config import recipes

    given = sys.argv[1:] if argv is None else argv
    argv = with_recipes(given)
    args = build_parser().parse_args(argv)
    args.recipe = recipes.named(given)  # recorded: the run says which recipe it started from
    try:
        resolve(args, argv)
    except UsageError as exc:
        raise UsageError(recipe_origin(str(exc), given, args.recipe)) from exc
    return Config.from_flat(vars(args))


def resolve(args: argparse.Namespace, argv: list[str]) -> None:
    """Preset, --init_from_hf's config.json, the cross-flag rules, the implementation and the
    FP8 recipe, into `args` (UsageError for a combination that cannot run)."""
    from model_utils.config import flag_rules, hf_config
    from model_utils.config.machine import has_cuda, resolve_model_impl  # imports torch

    apply_preset(args)
    if args.init_from_hf:
        try:
            hf_config.apply(args, explicit_flags(argv))
        except hf_config.ConfigError as exc:
            raise UsageError(str(exc)) from exc
    flag_rules.check_consistency(args)
    flag_rules.check_memory_snapshot(args, has_cuda())
    args.model_impl = resolve_model_impl(args.model_impl)
    rope_type = (args.rope_scaling or {}).get("rope_type", "default")
    if args.model_impl in TE_IMPLS and rope_type not in hf_config.TE_ROPE_TYPES:
        raise UsageError(
            f"--model_impl {args.model_impl} computes RoPE of types "
            f"{', '.join(hf_config.TE_ROPE_TYPES)}, not {rope_type!r} (from --init_from_hf): "
            "use --model_impl hf"
        )
    args.fp8_recipe = flag_rules.resolve_fp8_recipe(args)
    flag_rules.check_recipe_options(args, explicit_flags(argv))


def recipe_origin(message: str, given: list[str], recipe: str | None) -> str:
    """`message`, with the flags it names that the user did not type but `--recipe` set
    said to come from the recipe: the user typed the recipe's name, not its flags."""
    from model_utils.config import recipes

    if not recipe:
        return message
    typed = [a for i, a in enumerate(given) if not _is_recipe_arg(given, i)]
    supplied = explicit_flags(recipes.flags(recipe)) - explicit_flags(typed)
    named = [f"--{n}" for n in sorted(supplied) if re.search(rf"--{n}\b(?!_)", message)]
    return f"{message} ({', '.join(named)} from --recipe {recipe})" if named else message


def _is_recipe_arg(argv: list[str], i: int) -> bool:
    """Whether argv[i] is `--recipe`, `--recipe=NAME`, or the NAME after `--recipe`."""
    arg = argv[i]
    return arg == "--recipe" or arg.startswith("--recipe=") or (i > 0 and argv[i - 1] == "--recipe")


def with_recipes(argv: list[str] | None) -> list[str]:
    """The command line with each --recipe replaced by its flags (model_utils/config/recipes.py)."""
    from model_utils.config import recipes

    try:
        return recipes.expand(sys.argv[1:] if argv is None else argv)
    except recipes.RecipeError as exc:
        raise UsageError(str(exc)) from exc


def explicit_flags(argv: list[str] | None = None) -> frozenset[str]:
    """The flags given on the command line (a recipe's included), not filled in by a default
    or a preset: on resume an explicit --lr means "use this lr", a default does not."""
    argv = with_recipes(argv)
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def exit_on_usage_error(exc: UsageError) -> None:
    """The single place that turns bad input into one line and exit code 2."""
    print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)
