"""What a Transformer Engine configuration needs, as pure rules: GPU architecture, CUDA, TE
release, FP8 shapes and FP8 attention backends, each answered with the message a user sees.

Read from TE's source (the releases in ``precision/te.py``'s TE_CONTRACT_VERSIONS); every rule takes
the GPU's SM and versions as arguments, so each message is tested on a CPU, and train.py refuses
in one line before a process group exists instead of failing inside TE after the launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.config.options import FP8_RECIPE, FP8_RECIPES, Fp8Recipe

if TYPE_CHECKING:
    from model_utils.config.sections import ModelShape


#: What each TE recipe needs (min_sm, min_cuda, min_te, hardware): its row of
#: config/options.FP8_RECIPES, and a row of the same shape for BF16 on TE.
REQUIREMENTS: dict[str, Fp8Recipe] = {
    "bf16": Fp8Recipe(
        "bf16", "te", min_sm=(8, 0), hardware="an NVIDIA GPU with BF16 (SM 8.0+, A100 or newer)"
    ),
    **{r.name: r for r in FP8_RECIPES if r.backend == "te"},
}
#: FP8-only weights under FSDP2 (``--fp8_weights``): TE 2.16 is the first release without the
#: FSDP2 FP8 weight-workspace leak (TE PR #2805) and with block-scaled weights built on CUDA.
FP8_WEIGHTS_MIN_TE = (2, 16)
#: ``--fp8_backward`` sets the recipes' ``backward_override`` (TE PR #2644, first released in
#: 2.15; delayed scaling accepts only None there, so its row does not read the flag).
FP8_BACKWARD_MIN_TE = (2, 15)
#: ``--ac_scope mlp`` on ``--model_impl te`` sets ``LayerNormMLP.checkpoint``, TE's selective
#: recompute of the fused MLP (TE PR #2311, first released in 2.11).
MLP_RECOMPUTE_MIN_TE = (2, 11)
#: From this release TE refuses to unpickle delayed-scaling ``_extra_state`` unless
#: ``TE_UNSAFE_PICKLE_ENV=1`` (``transformer_engine/pytorch/_extra_state.py``). This recipe's
#: checkpoints hold no pickle (checkpoint format 2) and it never sets the variable.
TE_REFUSES_PICKLED_EXTRA_STATE = (2, 18)
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


class TECapabilityError(RuntimeError):
    """This machine (GPU, CUDA, TE release) cannot run the requested TE configuration."""


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def capability_problem(
    recipe: str,
    *,
    sm: tuple[int, int] | None,
    cuda_version: str | None,
    te_version: str | None,
    fp8_weights: bool = False,
    fp8_backward: bool = False,
    mlp_recompute: bool = False,
) -> str | None:
    """The first reason ``recipe`` ("bf16" or a TE recipe) cannot run here, or ``None``.

    Pure: the caller passes the GPU's SM (``None`` = no CUDA GPU), ``torch.version.cuda`` and
    TE's version (``None`` = not installed), so every message is testable on a CPU.
    """
    need = REQUIREMENTS[recipe]
    label = "BF16 on Transformer Engine" if recipe == "bf16" else f"--fp8_recipe {recipe}"
    te_release = version_tuple(te_version)
    if te_release is None:
        return f"{label} needs Transformer Engine >= {_fmt(need.min_te)}, which is not installed"
    if te_release < need.min_te:
        return f"{label} needs Transformer Engine >= {_fmt(need.min_te)}, found {te_version}"
    if fp8_weights and te_release < FP8_WEIGHTS_MIN_TE:
        return (
            f"--fp8_weights needs Transformer Engine >= {_fmt(FP8_WEIGHTS_MIN_TE)}, "
            f"found {te_version}"
        )
    if fp8_backward and te_release < FP8_BACKWARD_MIN_TE:
        return (
            f"--fp8_backward needs Transformer Engine >= {_fmt(FP8_BACKWARD_MIN_TE)} (the "
            f"recipes' backward_override), found {te_version}: drop it"
        )
    if mlp_recompute and te_release < MLP_RECOMPUTE_MIN_TE:
        return (
            f"--ac_scope mlp with --model_impl te needs Transformer Engine >= "
            f"{_fmt(MLP_RECOMPUTE_MIN_TE)} (LayerNormMLP's recompute), found {te_version}: "
            "use --ac_scope layer"
        )
    if sm is None:
        return f"{label} needs {need.hardware}; no CUDA GPU is visible"
    if tuple(sm) < need.min_sm:
        return f"{label} needs {need.hardware}; this GPU is SM {sm[0]}.{sm[1]}"
    cuda = version_tuple(cuda_version)
    if need.min_cuda and (cuda is None or cuda < need.min_cuda):
        return f"{label} needs {need.hardware}; this PyTorch was built with CUDA {cuda_version}"
    return None


def fp8_shape_problem(
    shape: ModelShape, micro_batch_size: int, *, recipe: str = "delayed"
) -> str | None:
    """Why these shapes cannot run FP8 GEMMs, or ``None``.

    Every FP8 GEMM operand needs both dimensions divisible by 16 (32 for MXFP8's blocks). The
    forward GEMMs see ``[tokens, features]``; the weight-gradient GEMM consumes the transposed
    activations, so tokens per micro-batch become an inner dimension and must obey the rule too.
    """
    multiple = FP8_RECIPE[recipe].gemm_multiple
    tokens = micro_batch_size * shape.max_context_width
    dims = {
        "tokens per micro-batch (train_batch_size x max_context_width)": tokens,
        "hidden_width": shape.hidden_width,
        "intermediate_size": shape.intermediate_size,
        "query width (num_heads x head_dim)": shape.num_heads * shape.head_dim,
        "key/value width (num_key_value_heads x head_dim)": (
            shape.num_key_value_heads * shape.head_dim
        ),
    }
    bad = [f"{name} = {value}" for name, value in dims.items() if value % multiple]
    if not bad:
        return None
    return f"FP8 ({recipe}) needs multiples of {multiple}: " + "; ".join(bad)


#: cuDNN's FP8 fused attention on Hopper (TE 2.20 ``nvte_get_fused_attn_backend``, sm < 100):
#: head_dim 128 for Q, K and V. TE finds no other FP8 attention backend in training.
FP8_ATTENTION_HOPPER_HEAD_DIM = 128

#: Deterministic FP8 attention in training (TE 2.20, "Disabling FusedAttention for determinism
#: reasons with FP8 on arch < sm90 or cuDNN < 9.19.0").
FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN = (9, 19, 0)


def fp8_attention_problem(
    recipe: str,
    *,
    sm: tuple[int, int],
    head_dim: int,
    deterministic: bool = False,
    cudnn: tuple[int, int, int] | None = None,
) -> str | None:
    """Why TE would find no FP8 attention backend for this recipe, GPU and head width, or None.

    Read from TE 2.20's ``get_attention_backend``: only cuDNN's FusedAttention runs FP8 in
    training (FlashAttention is disabled for FP8); on SM 9.x it needs delayed scaling ("Disabling
    FusedAttention for FP8 current scaling on arch < sm100") and head_dim 128, on SM 10.0+ a
    head_dim of at most 128 in multiples of 16, and SM 12.0 has none; deterministic
    mode (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or torch's deterministic algorithms) needs
    cuDNN >= 9.19. TE would raise "No dot product attention backend is available" at the first
    forward, after the launch.
    """
    where = f"this GPU is SM {sm[0]}.{sm[1]}"
    if tuple(sm) < (9, 0):
        return f"--fp8_attention needs cuDNN's FP8 fused attention on SM 9.0+ (Hopper); {where}"
    if deterministic and cudnn is not None and cudnn < FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN:
        need = _fmt(FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN)
        return (
            f"--fp8_attention in deterministic mode (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch's "
            f"deterministic algorithms) needs cuDNN >= {need}, found {_fmt(cudnn)}: "
            "allow non-deterministic algorithms, point TE at a newer cuDNN (CUDNN_HOME), or "
            "drop --fp8_attention"
        )
    if tuple(sm) == (12, 0):  # TE: "FP8 is not supported for compute capability = sm120"
        return f"--fp8_attention: TE has no FP8 attention on SM 12.0; {where}"
    if tuple(sm) >= (10, 0):  # cuDNN's FP8 fused attention there (fused_attn.cpp)
        if head_dim > 128 or head_dim % 16:
            return (
                f"--fp8_attention on SM 10.0+ needs a head_dim of at most 128 and a multiple of "
                f"16 (cuDNN's FP8 attention); this model has {head_dim} (hidden_width / num_heads)"
            )
        return None
    if recipe != "delayed":
        return (
            f"--fp8_attention with --fp8_recipe {recipe} needs SM 10.0+ (Blackwell); {where}: "
            "on Hopper use --fp8_recipe delayed"
        )
    if head_dim != FP8_ATTENTION_HOPPER_HEAD_DIM:
        return (
            f"--fp8_attention on SM 9.x needs head_dim {FP8_ATTENTION_HOPPER_HEAD_DIM} "
            f"(cuDNN's FP8 attention); this model has {head_dim} (hidden_width / num_heads)"
        )
    return None
