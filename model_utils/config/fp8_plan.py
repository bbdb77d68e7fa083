"""A run's FP8 plan, and the FP8 rules that need the recipe's row, in one place.

Start-up (arguments.resolve) decides --fp8_recipe for the implementation's backend and checks
what FP8 can run with it; the precision backends, the model build and the run log then read
one frozen Fp8Plan (:func:`plan_of`), not the precision flags one by one. A new FP8 lever is
one flag field (with its needs and excludes: sections.py), one plan field and the code that
acts. What the machine must have (GPU, CUDA, TE, cuDNN) is precision/te_requirements'.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from model_utils.config.options import (
    FP8_ATTENTION_RECIPES,
    FP8_RECIPE,
    TE_IMPLS,
    TE_RECIPE_OPTIONS,
    TE_RECIPES,
    TORCHAO_RECIPES,
    Fp8Recipe,
)
from model_utils.config.run_config import Config
from model_utils.errors import UsageError


@dataclass(frozen=True)
class Fp8Plan:
    """What FP8 does in this run. With FP8 off, `recipe` is None and every lever is off."""

    recipe: Fp8Recipe | None = None
    #: The TE recipe flags the recipe's class reads -> their values (empty for torchao).
    te_options: Mapping[str, Any] = field(default_factory=dict)
    #: Decoder layers kept in BF16 (--bf16_layers, checked against --num_layers), from 0, sorted.
    kept_layers: tuple[int, ...] = ()
    lm_head: bool = False  # the output layer's GEMMs in FP8 (--fp8_lm_head)
    attention: bool = False  # TE's fused attention in FP8 (--fp8_attention)
    weights: bool = False  # weights kept only in FP8 (--fp8_weights)
    all_gather: bool = False  # FSDP2 gathers float8 weights (--fp8_all_gather)
    numerics: bool = False  # FP8 casts measured at report steps (--fp8_numerics)
    #: The first step (counted from 0) trained in BF16 (--bf16_cooldown), or None: FP8 to the end.
    cooldown_from: int | None = None

    @property
    def on(self) -> bool:
        return self.recipe is not None

    @property
    def kept_words(self) -> str:
        """``decoder layers 0, 15`` for the start-up line (--bf16_layers)."""
        layers = self.kept_layers
        return "decoder layer" + "s" * (len(layers) > 1) + " " + ", ".join(map(str, layers))


def te_options(recipe: Fp8Recipe, values: Mapping[str, Any]) -> dict[str, Any]:
    """The TE recipe flags `recipe`'s class reads (its row's knobs, and --fp8_attention where it
    has an FP8 attention path; none for torchao) -> their values in `values`."""
    read = (*recipe.knobs, *(("fp8_attention",) if recipe.attention else ()))
    return {knob: values[knob] for knob in read}


def plan_of(config: Config) -> Fp8Plan:
    """The FP8 plan of a resolved config (its recipe decided and checked by :func:`resolved`):
    a pure function of the frozen config, so every reader gets the same plan."""
    precision, layers = config.precision, config.model.num_layers
    if not precision.fp8:
        return Fp8Plan()
    recipe = FP8_RECIPE[precision.fp8_recipe]
    return Fp8Plan(
        recipe,
        te_options(recipe, config.as_dict()),
        tuple(sorted({int(i) % layers for i in precision.bf16_layers.split(",") if i})),
        precision.fp8_lm_head,
        precision.fp8_attention,
        precision.fp8_weights,
        precision.fp8_all_gather,
        config.run.fp8_numerics,
        cooldown_from(config.run.max_steps, precision.bf16_cooldown),
    )


def cooldown_from(max_steps: int, fraction: float) -> int | None:
    """The step a BF16 cool-down of ``fraction`` of ``max_steps`` starts at: at least the last
    step, never the first (a cool-down of a whole run is a BF16 run: --fp8=0)."""
    if not fraction:
        return None
    return max(1, min(max_steps - 1, round(max_steps * (1 - fraction))))


def resolved(config: Config, cuda: bool) -> Config:
    """The config with --fp8_recipe decided for the (resolved) --model_impl's backend, once every
    FP8 rule that reads the recipe's row holds (UsageError, one line, for the first that does
    not)."""
    _check_fp8_compute(config, cuda)
    config = config.replace(fp8_recipe=_recipe_for_backend(config))
    precision, recipe = config.precision, config.precision.fp8_recipe
    uses_te = precision.model_impl in TE_IMPLS
    if precision.fp8_all_gather and (uses_te or recipe != "tensorwise"):
        raise UsageError(
            "--fp8_all_gather needs torchao's tensorwise recipe (--model_impl hf "
            "--fp8_recipe tensorwise); with TE use --fp8_weights"
        )
    if precision.fp8_weights and not uses_te:
        raise UsageError("--fp8_weights is a Transformer Engine option: add --model_impl te")
    tokens = config.data.train_batch_size * config.model.max_context_width
    multiple = FP8_RECIPE[recipe].gemm_multiple
    if cuda and precision.fp8 and recipe in TORCHAO_RECIPES and tokens % multiple:
        raise UsageError(  # torch._scaled_mm on CUDA; torchao's CPU emulation has no such rule
            f"torchao's FP8 on a GPU needs the tokens per micro-batch (--train_batch_size x "
            f"--max_context_width = {tokens}) to be a multiple of {multiple}: the weight "
            "gradient's GEMM sums over them"
        )
    if precision.fp8_weights and recipe == "block" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(  # TE 2.20's own FSDP2 tests expect this pair to fail (xfail)
            "--fp8_weights with --fp8_recipe block cannot be sharded over ranks: FSDP2's "
            "all-gather misplaces each shard's 128-row block scales (TE's known limit); use "
            "--fp8_recipe delayed or current, or --fp8_weights off"
        )
    if precision.fp8_attention and recipe not in FP8_ATTENTION_RECIPES:
        # TE 2.20: Float8BlockScaling asserts ``not fp8_dpa``; MXFP8's needs cuDNN >= 9.21
        raise UsageError(
            f"--fp8_attention has no FP8 attention path with --fp8_recipe {recipe}: use "
            f"--fp8_recipe {' or '.join(FP8_ATTENTION_RECIPES)} (on Hopper: delayed)"
        )
    if config.run.fp8_numerics:
        _check_fp8_numerics(config, recipe)
    _check_recipe_options(config)
    if precision.fp8 and precision.fp8_backward != "fp8" and precision.model_impl == "te":
        raise UsageError(  # TE 2.15-2.20's LayerNormMLP asserts backward_override is None
            f"--fp8_backward {precision.fp8_backward} has no path through --model_impl te's "
            "fused MLP (TE's LayerNormMLP refuses it): use --model_impl te_linear"
        )
    return config


def _check_fp8_compute(config: Config, cuda: bool) -> None:
    """FP8 layers run inside a bf16 model on a GPU. Where FP8 is emulated (torchao on a CPU),
    --bf16=0 computes around the FP8 casts in fp32: a CPU without bf16 units runs bf16 matmuls
    10-25x slower than fp32 ones (measured in benchmarks/results/)."""
    if (
        config.precision.fp8
        and not config.precision.bf16
        and (cuda or config.precision.model_impl in TE_IMPLS)
    ):
        raise UsageError(
            "--fp8=1 needs --bf16=1 on a GPU or with Transformer Engine (FP8 layers run inside "
            "a bf16 model); only torchao's CPU emulation computes around FP8 in fp32"
        )


def _recipe_for_backend(config: Config) -> str:
    """--fp8_recipe for the backend that --model_impl runs on: TE's recipes for the TE
    implementations, torchao's for hf; defaulted to that backend's first recipe."""
    uses_te = config.precision.model_impl in TE_IMPLS
    valid = TE_RECIPES if uses_te else TORCHAO_RECIPES
    recipe = valid[0] if config.precision.fp8_recipe is None else config.precision.fp8_recipe
    if recipe not in valid:
        backend = "Transformer Engine" if uses_te else "torchao"
        raise UsageError(
            f"--fp8_recipe {recipe} is not a {backend} recipe for --model_impl "
            f"{config.precision.model_impl}; choose one of {', '.join(valid)}"
        )
    return recipe


def _check_fp8_numerics(config: Config, recipe: str) -> None:
    """The figures are per tensor or per row; TE's fused layers measure with TE's debug tools,
    which need the high-precision weight."""
    model_impl = config.precision.model_impl
    if model_impl in TE_IMPLS and recipe not in ("delayed", "current"):
        raise UsageError(
            f"--fp8_numerics covers per-tensor TE scaling (delayed, current), not --fp8_recipe "
            f"{recipe}'s blocks"
        )
    if model_impl == "te" and config.precision.fp8_weights:
        raise UsageError(
            "--fp8_numerics on --model_impl te measures each cast against the high-precision "
            "tensor, and --fp8_weights keeps no high-precision weight: drop one of them"
        )


def _check_recipe_options(config: Config) -> None:
    """A TE recipe option typed where no TE recipe reads it is refused: the user thinks it tunes
    the run. With --fp8=0 on TE it is let through, so one command line can toggle FP8."""
    for name, recipes in TE_RECIPE_OPTIONS.items():
        if name not in config.typed:
            continue
        if config.precision.model_impl not in TE_IMPLS:
            raise UsageError(
                f"--{name} is a Transformer Engine recipe option and does nothing with "
                f"--model_impl {config.precision.model_impl} (torchao): drop it, or use "
                "--model_impl te"
            )
        if config.precision.fp8 and config.precision.fp8_recipe not in recipes:
            raise UsageError(
                f"--{name} does nothing with --fp8_recipe {config.precision.fp8_recipe}: only "
                f"{', '.join(recipes[:-1])}{' and ' * (len(recipes) > 1)}{recipes[-1]} scaling "
                "read it; drop it or change --fp8_recipe"
            )


def check_training(config: Config) -> None:
    """What FP8 needs to train rather than only run forward (the GPU benchmark's rows).
    FP8-only weights need fp32 master weights in the optimizer (TE's
    FusedAdam(master_weights=True), as in TE's examples/pytorch/quantized_model_init/
    fully_shard.py); torch AdamW re-quantises every update to E4M3, so small updates vanish
    (the loss this cost on an H100: docs/checkpoints.md)."""
    if config.precision.fp8_weights and config.optim.master_weights != "optimizer":
        raise UsageError(
            "--fp8_weights keeps weights only in FP8, and training them needs fp32 master "
            "weights in the optimizer: add --master_weights optimizer (without it AdamW would "
            "re-quantise every update to FP8, and small updates vanish: docs/checkpoints.md)"
        )
