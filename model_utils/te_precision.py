"""Transformer Engine precision backend: FP8 recipes, capability checks, autocast.

Same seam as the other precision backends (``prepare`` / ``autocast`` / ``after_optimizer_step``
/ ``describe``). With ``args.fp8`` false the same TE model runs in BF16, so fp8-vs-bf16 runs
compare FP8 alone, not FP8 plus TE's kernel fusion.

TE is imported lazily; building the recipe, the shape rules and the capability messages are
pure functions testable without TE or a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from model_utils.arguments import TE_RECIPES
from model_utils.te_support import TEUnavailableError, import_te, set_is_first_microbatch

#: The Transformer Engine releases this code is contract-tested against, the one place they are
#: stated: tests/integration/test_te_contract.py downloads each one's pure-Python
#: ``transformer-engine`` wheel (scripts/fetch_te_wheel.sh) and checks every TE name and keyword
#: we use against its source.
#: PINNED: the newest release; the TE test double mirrors its signatures.
PINNED_TE_VERSION = "2.20.2"
#: IMAGE: the release the GPU image ships (0.transformer-engine.dockerfile: NGC PyTorch 26.06 has
#: TE 2.16; 2.16.0 is that line's first release, the API floor of any 2.16.x build).
IMAGE_TE_VERSION = "2.16.0"
TE_CONTRACT_VERSIONS: tuple[str, ...] = (PINNED_TE_VERSION, IMAGE_TE_VERSION)

#: ``--fp8_format`` -> ``recipe.Format`` member. HYBRID = E4M3 forward, E5M2 gradients.
TE_FORMATS: dict[str, str] = {"hybrid": "HYBRID", "e4m3": "E4M3"}
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class Requirement:
    """What a recipe needs: GPU architecture, CUDA toolkit, TE release."""

    min_sm: tuple[int, int]
    min_cuda: tuple[int, int] | None
    min_te: tuple[int, int]
    hardware: str


#: Per recipe (and for BF16 on TE). SM 8.9 = Ada (L4/L40), 9.0 = Hopper (H100/H200),
#: 10.0 = Blackwell (B200). TE minimums are the releases that introduced each recipe.
REQUIREMENTS: dict[str, Requirement] = {
    "bf16": Requirement((8, 0), None, (2, 1), "an NVIDIA GPU with BF16 (SM 8.0+, A100 or newer)"),
    "delayed": Requirement((8, 9), None, (2, 1), "SM 8.9+ (Ada, Hopper or newer)"),
    "current": Requirement((8, 9), None, (2, 2), "SM 8.9+ (Ada, Hopper or newer)"),
    "block": Requirement((9, 0), (12, 9), (2, 3), "SM 9.0+ (Hopper) and CUDA >= 12.9"),
    "mxfp8": Requirement((10, 0), None, (2, 1), "SM 10.0+ (Blackwell)"),
}
#: TE's own availability check per recipe (``fn(return_reason=True) -> (ok, reason)``).
TE_AVAILABILITY_CHECKS: dict[str, str] = {
    "delayed": "is_fp8_available",
    "current": "is_fp8_available",
    "block": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}
#: FP8-only weights under FSDP2 (``--fp8_weights``): TE 2.16 is the first release without the
#: FSDP2 FP8 weight-workspace leak (TE PR #2805) and with block-scaled weights built on CUDA.
FP8_WEIGHTS_MIN_TE = (2, 16)
#: Why ``--fp8_weights`` cannot train here. FP8-only weights need FP32 master weights in the
#: optimizer (TE's FusedAdam(master_weights=True), as in TE's examples/pytorch/
#: quantized_model_init/fully_shard.py); torch AdamW re-quantises every update to E4M3, so small
#: updates vanish (on an H100, 40 steps: final loss 3.0% worse with delayed scaling, 2.6% with
#: current). TE's FSDP2 tests also mark block-scaled FP8 weights xfail on several GPUs.
FP8_WEIGHTS_TRAINING_REFUSAL = (
    "--fp8_weights keeps weights only in FP8, and training them needs FP32 master weights in the "
    "optimizer (TE FusedAdam(master_weights=True)), which this recipe does not build yet: AdamW "
    "would re-quantise every update (3% worse loss measured on an H100); train without "
    "--fp8_weights (FP8 GEMMs stay on) and use it for inference (benchmarks/bench_gpu_matrix.py)"
)


#: From this release TE refuses to unpickle delayed-scaling ``_extra_state`` unless
#: ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (``transformer_engine/pytorch/_extra_state.py``).
TE_REFUSES_PICKLED_EXTRA_STATE = (2, 18)


def pickled_fp8_state_problem(
    path: Any, marker: dict[str, Any], te_version: str | None, env: Any
) -> str | None:
    """Why resuming checkpoint ``path`` (its ``checkpoint.json`` is ``marker``) would be refused
    by this TE, or None. Format-1 checkpoints of TE delayed-scaling runs hold TE's pickled FP8
    state; TE >= 2.18 loads it only when the user opts in (we never set the variable)."""
    from model_utils.checkpoint import TE_UNSAFE_PICKLE_ENV, untrusted_checkpoint_message

    config = marker.get("run_config") or {}
    pickled = (
        int(marker.get("format", 1)) < 2
        and config.get("model_impl") in ("te", "te_linear")
        and bool(config.get("fp8"))
        and config.get("fp8_recipe") == "delayed"
    )
    release = _version_tuple(te_version)
    if not pickled or release is None or release < TE_REFUSES_PICKLED_EXTRA_STATE:
        return None
    if env.get(TE_UNSAFE_PICKLE_ENV, "0") == "1":
        return None
    return untrusted_checkpoint_message(path, te_version)


class TECapabilityError(RuntimeError):
    """This machine (GPU, CUDA, TE release) cannot run the requested TE configuration."""


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
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
) -> str | None:
    """The first reason ``recipe`` ("bf16" or a TE recipe) cannot run here, or ``None``.

    Pure: the caller passes the GPU's SM (``None`` = no CUDA GPU), ``torch.version.cuda`` and
    TE's version (``None`` = not installed), so every message is testable on a CPU.
    """
    need = REQUIREMENTS[recipe]
    label = "BF16 on Transformer Engine" if recipe == "bf16" else f"--fp8_recipe {recipe}"
    te_release = _version_tuple(te_version)
    if te_release is None:
        return f"{label} needs Transformer Engine >= {_fmt(need.min_te)}, which is not installed"
    if te_release < need.min_te:
        return f"{label} needs Transformer Engine >= {_fmt(need.min_te)}, found {te_version}"
    if fp8_weights and te_release < FP8_WEIGHTS_MIN_TE:
        return (
            f"--fp8_weights needs Transformer Engine >= {_fmt(FP8_WEIGHTS_MIN_TE)}, "
            f"found {te_version}"
        )
    if sm is None:
        return f"{label} needs {need.hardware}; no CUDA GPU is visible"
    if tuple(sm) < need.min_sm:
        return f"{label} needs {need.hardware}; this GPU is SM {sm[0]}.{sm[1]}"
    cuda = _version_tuple(cuda_version)
    if need.min_cuda and (cuda is None or cuda < need.min_cuda):
        return f"{label} needs {need.hardware}; this PyTorch was built with CUDA {cuda_version}"
    return None


def fp8_shape_problem(
    *,
    micro_batch_size: int,
    seq_len: int,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int | None = None,
    recipe: str = "delayed",
) -> str | None:
    """Why these shapes cannot run FP8 GEMMs, or ``None``.

    Every FP8 GEMM operand needs both dimensions divisible by 16 (32 for MXFP8's blocks). The
    forward GEMMs see ``[tokens, features]``; the weight-gradient GEMM consumes the transposed
    activations, so tokens per micro-batch become an inner dimension and must obey the rule too.
    """
    multiple = 32 if recipe == "mxfp8" else 16
    head_dim = head_dim or hidden_size // num_attention_heads
    dims = {
        "tokens per micro-batch (train_batch_size x max_context_width)": micro_batch_size * seq_len,
        "hidden_width": hidden_size,
        "intermediate_size": intermediate_size,
        "query width (num_heads x head_dim)": num_attention_heads * head_dim,
        "key/value width (num_key_value_heads x head_dim)": num_key_value_heads * head_dim,
    }
    bad = [f"{name} = {value}" for name, value in dims.items() if value % multiple]
    if not bad:
        return None
    return f"FP8 ({recipe}) needs multiples of {multiple}: " + "; ".join(bad)


def import_recipe_module() -> Any:
    """``transformer_engine.common.recipe`` (lazy: TE may be absent)."""
    return importlib.import_module("transformer_engine.common.recipe")


def build_recipe(
    name: str,
    *,
    fp8_format: str = "hybrid",
    amax_history_len: int = 1024,
    amax_compute_algo: str = "max",
    fp8_margin: int = 0,
) -> Any:
    """The TE recipe object for ``--fp8_recipe name`` and its options.

    ``amax_history_len``/``amax_compute_algo`` only exist for delayed scaling (the others
    compute scales from the current tensor or block); ``margin`` exists for delayed and MXFP8.
    """
    if name not in TE_RECIPES:
        raise ValueError(f"unknown TE fp8 recipe {name!r}; choose from {', '.join(TE_RECIPES)}")
    if fp8_format not in TE_FORMATS:
        raise ValueError(f"unknown fp8 format {fp8_format!r}; choose from {', '.join(TE_FORMATS)}")
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}")
    te_recipe = import_recipe_module()
    fmt = getattr(te_recipe.Format, TE_FORMATS[fp8_format])
    if name == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo,
            margin=fp8_margin,
        )
    if name == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if name == "block":
        return te_recipe.Float8BlockScaling(fp8_format=fmt)
    return te_recipe.MXFP8BlockScaling(fp8_format=fmt, margin=fp8_margin)


def _te_version(te_module: Any) -> str | None:
    root = importlib.import_module(te_module.__name__.split(".")[0])
    return getattr(root, "__version__", None)


def _has_te_modules(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


class TEBackend:
    """Precision backend for ``--model_impl te|te_linear``.

    ``args`` attributes: ``fp8`` (bool), ``fp8_recipe``, ``fp8_format``, ``amax_history_len``,
    ``amax_compute_algo``, ``fp8_margin``, ``fp8_weights``, ``model_impl``. ``dp_group`` is the
    whole data-parallel (FSDP) group: FP8 amaxes are all-reduced over it so every rank uses the
    same scales (``None`` = default group, or no reduction in a single process).

    The compute dtype normally comes from FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters),
    exactly as for the other backends; ``torch_autocast_dtype`` adds a ``torch.autocast`` for
    unsharded use (the GPU benchmark), which TE honours by casting inputs and weights.
    """

    name = "te"

    def __init__(
        self, args: Any, dp_group: Any = None, *, torch_autocast_dtype: torch.dtype | None = None
    ) -> None:
        self.fp8 = bool(args.fp8)
        self.recipe_name = args.fp8_recipe
        self.fp8_format = args.fp8_format
        self.fp8_weights = bool(getattr(args, "fp8_weights", False))
        self.model_impl = args.model_impl
        self.torch_autocast_dtype = torch_autocast_dtype
        self.dp_group = dp_group
        self._recipe_kwargs = {
            "fp8_format": args.fp8_format,
            "amax_history_len": int(args.amax_history_len),
            "amax_compute_algo": args.amax_compute_algo,
            "fp8_margin": int(args.fp8_margin),
        }
        self._recipe: Any = None
        self._model: nn.Module | None = None

    @property
    def recipe(self) -> Any:
        """The TE recipe (built on first use; ``None`` with FP8 off)."""
        if self.fp8 and self._recipe is None:
            self._recipe = build_recipe(self.recipe_name, **self._recipe_kwargs)
        return self._recipe if self.fp8 else None

    def _te(self) -> Any:
        try:
            return import_te()
        except TEUnavailableError as unavailable:
            err = unavailable.__cause__ or unavailable
            raise TECapabilityError(
                f"--model_impl {self.model_impl} needs Transformer Engine (import failed: {err}); "
                "use the NGC container (0.transformer-engine.dockerfile) or --model_impl hf"
            ) from err

    def capability_check(self) -> None:
        """Raise :class:`TECapabilityError` naming what is missing (GPU, CUDA, TE release).

        The GPU is read from torch when CUDA is visible; TE's own availability check for the
        recipe is consulted as well, so a TE build lacking a kernel is caught before training.
        """
        te = self._te()
        key = self.recipe_name if self.fp8 else "bf16"
        sm = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        version = _te_version(te)
        problem = capability_problem(
            key,
            sm=sm,
            cuda_version=torch.version.cuda,
            te_version=version,
            fp8_weights=self.fp8_weights,
        )
        if problem and sm is None and "no CUDA GPU" in problem:
            problem = None  # TE itself decides below (it knows its device; CPU builds have none)
        if problem:
            raise TECapabilityError(problem)
        if not self.fp8:
            return
        check = getattr(te, TE_AVAILABILITY_CHECKS[self.recipe_name])
        available, reason = check(return_reason=True)
        if not available:
            raise TECapabilityError(
                f"--fp8_recipe {self.recipe_name} needs {REQUIREMENTS[self.recipe_name].hardware}: "
                f"Transformer Engine reports: {reason}"
            )

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check the model really runs on TE modules and remember it (for micro-batch flags).

        The TE model is built by ``te_llama.build_te_llama``; nothing is swapped here.
        """
        if not _has_te_modules(model):
            raise ValueError(
                "the TE precision backend needs a TE model (--model_impl te or te_linear); "
                "use the torchao backend for --model_impl hf"
            )
        self._model = model
        return model

    @property
    def checkpoint_fn(self) -> Any:
        """Activation checkpointing function for ``checkpoint_wrapper``: TE's, non-reentrant.

        TE's version replays the forward's FP8 scaling state during the recompute.
        """
        te = self._te()
        return functools.partial(te.checkpoint, use_reentrant=False)

    @contextlib.contextmanager
    def autocast(self, first_micro_batch: bool | None = None) -> Iterator[None]:
        """Wrap the forward (not backward/optimizer): FP8 GEMMs inside when FP8 is on.

        ``first_micro_batch`` marks a training forward as the first micro-batch of a step (TE
        casts and caches FP8 weights) or a later one (reuses them); None (evaluation) caches
        nothing, so no cached FP8 weights can go stale. The flags are set on the model's TE
        modules, which HF's forward would not reach for ``te_linear``, and left in place on
        exit because activation recompute in backward must replay the forward's choice. One TE
        module must not run twice inside one autocast (the amax reduction happens at exit).

        Under FSDP2 (every model train.py builds) the flag stays None: FSDP2 gathers the weights
        anew for every forward, so there is nothing to cache, and TE >= 2.16 ignores the flag
        there (``cache_name = None if ... self.is_fsdp2``).
        """
        te = self._te()
        if self._model is not None:
            fsdp2 = isinstance(self._model, FSDPModule)
            set_is_first_microbatch(self._model, None if fsdp2 else first_micro_batch)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        with contextlib.ExitStack() as stack:
            if self.torch_autocast_dtype is not None:
                stack.enter_context(
                    torch.autocast(device_type=device_type, dtype=self.torch_autocast_dtype)
                )
            if self.fp8:
                if hasattr(te, "autocast"):
                    stack.enter_context(
                        te.autocast(
                            enabled=True,
                            recipe=self.recipe,
                            amax_reduction_group=self.dp_group,
                        )
                    )
                else:  # TE < 2.9
                    stack.enter_context(
                        te.fp8_autocast(
                            enabled=True, fp8_recipe=self.recipe, fp8_group=self.dp_group
                        )
                    )
            yield

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Nothing to do: TE updates FP8 scales when the autocast region exits, and FP8 weights
        are re-cast on the next ``is_first_microbatch=True`` forward."""

    def describe(self) -> str:
        """The startup log line: implementation, precision, recipe and its options."""
        activations = (
            "compute dtype from FSDP2"
            if self.torch_autocast_dtype is None
            else f"torch.autocast {str(self.torch_autocast_dtype).split('.')[-1]}"
        )
        if not self.fp8:
            return (
                f"model_impl={self.model_impl} precision=TE, fp8 off (same TE modules); "
                f"{activations}"
            )
        options = ", ".join(f"{k}={v}" for k, v in self._recipe_kwargs.items())
        group = "default group" if self.dp_group is None else "data-parallel group"
        weights = "FP8 (fp8_model_init)" if self.fp8_weights else "high precision"
        return (
            f"model_impl={self.model_impl} precision=TE FP8 recipe={self.recipe_name} "
            f"({TE_RECIPES[self.recipe_name]}: {options}); {activations}; "
            f"weights {weights}; amax reduction over the {group}"
        )


def check_requirements(args: Any, training: bool = True) -> None:
    """Everything about TE that can be refused before a process group or file exists.

    Raises ``model_utils.arguments.UsageError`` (one line, exit 2) for a missing TE, an
    unsupported GPU/CUDA/TE release for the recipe, or shapes FP8 GEMMs cannot take (training
    and validation micro-batches: validation runs under the same precision).
    """
    from model_utils.arguments import UsageError

    if training and getattr(args, "fp8_weights", False):
        raise UsageError(FP8_WEIGHTS_TRAINING_REFUSAL)
    try:
        backend = TEBackend(args)
        backend.capability_check()
        if backend.fp8:
            backend.recipe  # noqa: B018  (builds the recipe: bad options fail here)
    except (TECapabilityError, ValueError) as err:
        raise UsageError(str(err)) from err
    _check_resumable(args, _te_version(backend._te()))
    if not args.fp8:
        return
    for flag in ("train_batch_size", "val_batch_size"):
        problem = fp8_shape_problem(
            micro_batch_size=getattr(args, flag),
            seq_len=args.max_context_width,
            hidden_size=args.hidden_width,
            intermediate_size=args.intermediate_size,
            num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_key_value_heads,
            recipe=args.fp8_recipe,
        )
        if problem:
            raise UsageError(f"{problem} (--{flag} {getattr(args, flag)})")


def _check_resumable(args: Any, te_version: str | None) -> None:
    """Refuse, before anything starts, a resume this TE would refuse after the model is built."""
    from model_utils.arguments import UsageError
    from model_utils.checkpoint import read_marker, resolve_checkpoint

    resume = getattr(args, "resume_from_checkpoint", None)
    path = resolve_checkpoint(resume, args.checkpoint_dir) if resume else None
    if path is None:
        return
    problem = pickled_fp8_state_problem(path, read_marker(path), te_version, os.environ)
    if problem:
        raise UsageError(problem)
