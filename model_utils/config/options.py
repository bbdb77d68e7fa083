"""The values each flag takes: the choices of the command line, in one leaf module that the
flag parser, the rules between flags and the stages that act on a choice all read (so none of
them imports another to learn what a flag may say)."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_IMPLS = ("auto", "hf", "te", "te_linear")
#: ``--reshard_after_forward``: which FSDP2 units free their gathered parameters after forward.
RESHARD_POLICIES = ("default", "never", "always")
#: --sharding_strategy: FSDP2 over all ranks, HSDP (shard in a node), or no FSDP2 (a world of one)
SHARDING_STRATEGIES = ("full", "hybrid", "none")
#: What each checkpointed layer recomputes (``--ac_scope``): the whole decoder layer, or only
#: its MLP (for ``--model_impl te`` TE's own LayerNormMLP recompute, which skips fc2).
AC_SCOPES = ("layer", "mlp")
TE_IMPLS = ("te", "te_linear")  # the implementations that run on the TE precision backend
# adamw: torch's, fp32 moments; adamw8bit / adamw_fp8: torchao.optim's AdamW8bit / AdamWFp8.
OPTIMIZERS = ("adamw", "adamw8bit", "adamw_fp8")
#: Where the fp32 master weights live (``--master_weights``): in the parameters themselves (FSDP2
#: casts them to bf16 for compute), or in the optimizer beside bf16 parameters.
MASTER_WEIGHTS = ("params", "optimizer")
#: How the local data files are checked against a checkpoint's (``--verify_data``): size, ends
#: and sampled blocks (about 1 MiB read per file), or every byte.
DATA_CHECKS = ("sampled", "full")


@dataclass(frozen=True)
class Tracker:
    """One ``--tracker`` name: the package it needs before any process starts (None: in
    requirements.txt already) and its sink, the class of that name in report/trackers.py. A new
    tracker is that class and one row of TRACKERS; a test holds each row to its class."""

    name: str
    package: str | None
    sink: str


TRACKERS = (
    Tracker("tensorboard", None, "TensorBoardTracker"),
    Tracker("wandb", "wandb", "WandbTracker"),
    Tracker("mlflow", "mlflow", "MlflowTracker"),
)


@dataclass(frozen=True)
class Fp8Recipe:
    """One ``--fp8_recipe``, all that the flags, the rules, the TE backend and its requirements
    know of it. A new recipe is one row of FP8_RECIPES (and, for TE, its class in the TE double:
    tests/te_double), which the contract test walks against TE's source."""

    name: str
    backend: str  # "torchao" (--model_impl hf) or "te" (te, te_linear)
    #: TE: the class in ``transformer_engine.common.recipe``, and the flags it reads (each one
    #: keyword of that class: TE_RECIPE_KEYWORDS), ``--fp8_attention`` (``fp8_dpa``) aside.
    te_class: str | None = None
    knobs: tuple[str, ...] = ()
    attention: bool = False  # has an FP8 attention path (current scaling's needs SM 10.0+)
    #: What it needs (TE: the release that introduced it): GPU architecture, CUDA, TE release.
    min_sm: tuple[int, int] = (8, 9)
    min_cuda: tuple[int, int] | None = None
    min_te: tuple[int, int] = (2, 1)
    hardware: str = "SM 8.9+ (Ada, Hopper or newer)"
    te_check: str | None = None  # TE's own availability check (``fn(return_reason=True)``)
    gemm_multiple: int = 16  # every FP8 GEMM dimension a multiple of it


#: Every FP8 recipe, each backend's default first. SM 8.9 = Ada (L4/L40), 9.0 = Hopper
#: (H100/H200), 10.0 = Blackwell (B200).
FP8_RECIPES = (
    Fp8Recipe("tensorwise", "torchao"),
    Fp8Recipe("rowwise", "torchao"),
    Fp8Recipe("rowwise_with_gw_hp", "torchao"),
    Fp8Recipe(
        "delayed",
        "te",
        "DelayedScaling",
        ("fp8_format", "amax_history_len", "amax_compute_algo", "fp8_margin"),
        attention=True,
        te_check="is_fp8_available",
    ),
    Fp8Recipe(
        "current",
        "te",
        "Float8CurrentScaling",
        ("fp8_format", "fp8_backward"),
        attention=True,
        min_te=(2, 2),
        te_check="is_fp8_available",
    ),
    Fp8Recipe(
        "block",
        "te",
        "Float8BlockScaling",
        ("fp8_format", "fp8_backward"),
        min_sm=(9, 0),
        min_cuda=(12, 9),
        min_te=(2, 3),
        hardware="SM 9.0+ (Hopper) and CUDA >= 12.9",
        te_check="is_fp8_block_scaling_available",
    ),
    Fp8Recipe(
        "mxfp8",
        "te",
        "MXFP8BlockScaling",
        ("fp8_format", "fp8_margin", "fp8_backward"),
        min_sm=(10, 0),
        hardware="SM 10.0+ (Blackwell)",
        te_check="is_mxfp8_available",
        gemm_multiple=32,
    ),
)
#: Each TE recipe flag -> the keyword of TE's recipe classes it sets.
TE_RECIPE_KEYWORDS = {
    "fp8_format": "fp8_format",
    "amax_history_len": "amax_history_len",
    "amax_compute_algo": "amax_compute_algo",
    "fp8_margin": "margin",
    "fp8_backward": "backward_override",
    "fp8_attention": "fp8_dpa",
}
FP8_RECIPE = {recipe.name: recipe for recipe in FP8_RECIPES}
TORCHAO_RECIPES = tuple(r.name for r in FP8_RECIPES if r.backend == "torchao")
TE_RECIPES = tuple(r.name for r in FP8_RECIPES if r.backend == "te")
FP8_ATTENTION_RECIPES = tuple(r.name for r in FP8_RECIPES if r.attention)
#: TE recipe flags -> the recipes that read them (given for another they would do nothing).
TE_RECIPE_OPTIONS = {
    knob: tuple(r.name for r in FP8_RECIPES if knob in r.knobs)
    for knob in TE_RECIPE_KEYWORDS
    if knob != "fp8_attention"
}
