"""Transformer Engine precision backend: FP8 recipes, capability checks, autocast.

Same seam as the other precision backends (``prepare`` / ``autocast`` / ``after_optimizer_step``
/ ``describe``). With ``--fp8=0`` the same TE model runs in BF16, so fp8-vs-bf16 runs
compare FP8 alone, not FP8 plus TE's kernel fusion.

TE is imported lazily; building the recipe, the shape rules and the capability messages are
pure functions testable without TE or a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from model_utils.config import te_loader
from model_utils.config.fp8_plan import check_training, plan_of, te_options
from model_utils.config.options import FP8_RECIPE, TE_RECIPE_KEYWORDS, TE_RECIPES
from model_utils.config.run_config import Config, flag_specs
from model_utils.config.te_loader import TEUnavailableError, import_te
from model_utils.errors import UsageError, refuse
from model_utils.precision.output_gemms import cool_lm_head
from model_utils.precision.te_requirements import (
    TECapabilityError,
    capability_problem,
    fp8_attention_problem,
    fp8_shape_problem,
)
from model_utils.precision.te_state import fp8_scaling_kept, set_is_first_microbatch

#: The Transformer Engine releases this code is contract-tested against, the one place they are
#: stated: tests/integration/test_te_contract.py downloads each one's pure-Python
#: ``transformer-engine`` wheel (tools/fetch_te_wheel.sh) and checks every TE name and keyword
#: we use against its source.
#: PINNED: the newest release; the TE test double mirrors its signatures.
PINNED_TE_VERSION = "2.20.2"
#: IMAGE: the release the GPU image ships (0.transformer-engine.dockerfile: NGC PyTorch 26.06 has
#: TE 2.16; 2.16.0 is that line's first release, the API floor of any 2.16.x build).
IMAGE_TE_VERSION = "2.16.0"
TE_CONTRACT_VERSIONS: tuple[str, ...] = (PINNED_TE_VERSION, IMAGE_TE_VERSION)

#: ``--fp8_format`` -> ``recipe.Format`` member. HYBRID = E4M3 forward, E5M2 gradients.
TE_FORMATS: dict[str, str] = {"hybrid": "HYBRID", "e4m3": "E4M3"}


def import_recipe_module() -> Any:
    """``transformer_engine.common.recipe`` (lazy: TE may be absent; it loads cuDNN, so first
    point it at torch's, as ``import_te`` does)."""
    te_loader.align_te_cudnn()
    return importlib.import_module("transformer_engine.common.recipe")


def build_recipe(name: str, **options: Any) -> Any:
    """TE's recipe object for ``--fp8_recipe name``: its row's class (config/options.FP8_RECIPES)
    given the TE recipe flags the row reads, by TE's keyword names; `options` are flag values
    (a run's: its Fp8Plan's te_options), one not given taking its flag's default."""
    recipe = FP8_RECIPE.get(name)
    if recipe is None or recipe.backend != "te":
        raise ValueError(f"unknown TE fp8 recipe {name!r}; choose from {', '.join(TE_RECIPES)}")
    defaults = {knob: flag_specs()[knob].default for knob in TE_RECIPE_KEYWORDS}
    read = te_options(recipe, {**defaults, **options})
    keywords = {TE_RECIPE_KEYWORDS[knob]: value for knob, value in read.items()}
    te_recipe = import_recipe_module()
    keywords["fp8_format"] = getattr(te_recipe.Format, TE_FORMATS[keywords["fp8_format"]])
    backward = keywords.pop("backward_override", "fp8")
    te_class = getattr(te_recipe, recipe.te_class)
    if "backward_override" in {f.name for f in dataclasses.fields(te_class)}:  # TE >= 2.15
        # given always: TE's default is NVTE_BACKWARD_OVERRIDE's value, which delayed refuses
        keywords["backward_override"] = None if backward == "fp8" else backward
    return te_class(**keywords)


def attention_is_deterministic() -> bool:
    """TE's own test (``DotProductAttention.__init__``): the variable or torch's switch."""
    return (
        os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        or torch.are_deterministic_algorithms_enabled()
    )


def cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN that TE's attention runs on, as TE reports it (its backend choice reads the same
    number); None without TE.

    Not torch's ``cudnn.version()``: TE loads its own libcudnn, and where that one differs from
    the cuDNN torch was built with, torch's call raises instead of answering (docs/failures.md,
    "Where the rules came from").
    """
    try:
        te = import_te()
    except TEUnavailableError:
        return None
    major, minor, patch = te.get_cudnn_version()
    return int(major), int(minor), int(patch)


def _te_version(te_module: Any) -> str | None:
    root = importlib.import_module(te_module.__name__.split(".")[0])
    return getattr(root, "__version__", None)


def te_autocast(te: Any, *, enabled: bool, recipe: Any = None, group: Any = None) -> Any:
    """TE's FP8 autocast by this release's name (TE < 2.9: fp8_autocast): the one version shim."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


class TEBackend:
    """Precision backend for ``--model_impl te|te_linear``.

    ``dp_group`` is the whole data-parallel (FSDP) group: FP8 amaxes are all-reduced over it so
    every rank uses the same scales (``None`` = default group, or no reduction in a single
    process).

    The compute dtype normally comes from FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters),
    exactly as for the other backends; ``torch_autocast_dtype`` adds a ``torch.autocast`` for
    unsharded use (the GPU benchmark), which TE honours by casting inputs and weights.
    """

    name = "te"

    def __init__(
        self,
        config: Config,
        dp_group: Any = None,
        *,
        torch_autocast_dtype: torch.dtype | None = None,
        numerics: bool = False,
    ) -> None:
        """``numerics`` (a training run's --fp8_numerics on the fused layers) starts TE's debug
        tools here, before the model's first TE module exists, as TE requires."""
        self.plan = plan_of(config)
        self.fp8 = self.plan.on
        self.cooled = False  # --bf16_cooldown reached: the autocast leaves TE's FP8 off
        self.masters_in_optimizer = config.optim.master_weights == "optimizer"
        self.model_impl = config.precision.model_impl
        #: TE's own MLP recompute (``--ac_scope mlp`` on the fused layer) has a TE floor.
        self.mlp_recompute = (
            config.precision.model_impl == "te"
            and config.parallel.activation_checkpointing
            and config.parallel.ac_scope == "mlp"
        )
        self.torch_autocast_dtype = torch_autocast_dtype
        self.dp_group = dp_group
        self.head_dim = config.model.head_dim  # for the FP8 attention backend rules
        self._recipe: Any = None
        self._model: nn.Module | None = None
        self.debug = None
        if numerics:
            from model_utils.precision.numerics import TeDebug

            self.debug = TeDebug(
                f"{config.run.output_dir}/fp8_numerics",
                config.run.logging_freq,
                delayed=self.te_recipe.delayed(),
                kept=self.plan.kept_layers,
            )

    @property
    def te_recipe(self) -> Any:
        """The TE recipe (built on first use; ``None`` with FP8 off): PrecisionBackend's name,
        the same on every backend."""
        if self.fp8 and self._recipe is None:
            self._recipe = build_recipe(self.plan.recipe.name, **self.plan.te_options)
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
        sm = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        recipe = self.plan.recipe
        problem = capability_problem(
            recipe.name if recipe else "bf16",
            sm=sm,
            cuda_version=torch.version.cuda,
            te_version=_te_version(te),
            fp8_weights=self.plan.weights,
            fp8_backward=self.plan.te_options.get("fp8_backward", "fp8") != "fp8",
            mlp_recompute=self.mlp_recompute,
        )
        # no GPU visible: TE itself decides below (it knows its device; CPU builds have none)
        if not (sm is None and "no CUDA GPU" in (problem or "")):
            refuse(problem, TECapabilityError)
        if recipe is None:
            return
        available, reason = getattr(te, recipe.te_check)(return_reason=True)
        if not available:
            raise TECapabilityError(
                f"--fp8_recipe {recipe.name} needs {recipe.hardware}: "
                f"Transformer Engine reports: {reason}"
            )
        if self.plan.attention:
            problem = fp8_attention_problem(
                recipe.name,
                sm=sm or te.get_device_compute_capability(),
                head_dim=self.head_dim,
                deterministic=attention_is_deterministic(),
                cudnn=cudnn_version(),
            )
            refuse(problem, TECapabilityError)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check the model really runs on TE modules and remember it (for micro-batch flags).

        The TE model is built by ``te_llama.build_te_llama``; nothing is swapped here.
        """
        if not any(type(m).__module__.startswith("transformer_engine") for m in model.modules()):
            raise ValueError(
                "the TE precision backend needs a TE model (--model_impl te or te_linear); "
                "use the torchao backend for --model_impl hf"
            )
        self._model = model
        if self.debug:
            self.debug.name_layers(model)
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

        With grad disabled (validation) the delayed-scaling state is put back on exit
        (``te_state.fp8_scaling_kept``): held-out batches never move training's scales.
        """
        te = self._te()
        if self._model is not None:
            fsdp2 = isinstance(self._model, FSDPModule)
            set_is_first_microbatch(self._model, None if fsdp2 else first_micro_batch)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        with contextlib.ExitStack() as stack:
            if self.fp8 and self._model is not None and not torch.is_grad_enabled():
                stack.enter_context(fp8_scaling_kept(self._model))  # exits after TE's autocast
            if self.torch_autocast_dtype is not None:
                # without its weight cache: TE casts its own weights, and --cuda_graphs'
                # capture refuses the cache
                autocast = torch.autocast(
                    device_type=device_type, dtype=self.torch_autocast_dtype, cache_enabled=False
                )
                stack.enter_context(autocast)
            if self.fp8 and not self.cooled:
                stack.enter_context(
                    te_autocast(te, enabled=True, recipe=self.te_recipe, group=self.dp_group)
                )
            yield

    def cool_down(self, model: nn.Module) -> None:
        """Outside TE's autocast its layers compute in the compute dtype; their FP8 state
        stays in the checkpoint as it was (``te_recipe`` too: the layers were built with it)."""
        self.cooled = True
        cool_lm_head(model)

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Nothing to do: TE updates FP8 scales when the autocast region exits, and FP8 weights
        are re-cast on the next ``is_first_microbatch=True`` forward."""

    def master_weight_adam(self, device: torch.device) -> Any:
        """TE's FusedAdam keeping fp32 master weights (``--master_weights optimizer``) on CUDA:
        one multi-tensor kernel reads the bf16 gradients and writes the fp32 masters, both
        moments and the rounded bf16 parameters. None elsewhere (FusedAdam is GPU-only), where
        optim's MasterWeightAdamW runs the same algorithm and keeps the same state."""
        if device.type != "cuda":
            return None
        te = self._te()
        return functools.partial(
            te.optimizers.FusedAdam, master_weights=True, master_weight_dtype=torch.float32
        )

    def describe(self) -> str:
        """The startup log line: implementation, precision, recipe and its options."""
        activations = (
            "compute dtype from FSDP2"
            if self.torch_autocast_dtype is None
            else f"torch.autocast {str(self.torch_autocast_dtype).split('.')[-1]}"
        )
        if self.masters_in_optimizer:
            activations += "; bf16 parameters, fp32 master weights in the optimizer"
        cudnn = _describe_cudnn()
        if not self.fp8:
            return (
                f"model_impl={self.model_impl} precision=TE, fp8 off (same TE modules); "
                f"{activations}{cudnn}"
            )
        plan = self.plan  # the options its recipe reads: current has no history
        options = ", ".join(f"{k}={v}" for k, v in plan.te_options.items())
        group = "default group" if self.dp_group is None else "data-parallel group"
        weights = "FP8 (fp8_model_init)" if plan.weights else "high precision"
        kept = f"; {plan.kept_words} in BF16" if plan.kept_layers else ""
        kept += "; lm_head's GEMMs in FP8 (chunked loss)" if plan.lm_head else ""
        kept += f"; BF16 from step {plan.cooldown_from + 1}" if plan.cooldown_from else ""
        return (
            f"model_impl={self.model_impl} precision=TE FP8 recipe={plan.recipe.name} "
            f"({plan.recipe.te_class}: {options}); {activations}; "
            f"weights {weights}{kept}; amax reduction over the {group}{cudnn}"
        )


def _describe_cudnn() -> str:
    """Which cuDNN TE runs on, for the start-up line: FP8 attention's rules and torch's own
    cuDNN calls depend on it (``te_loader``)."""
    version = cudnn_version()
    if version is None:
        return ""
    home = os.environ.get("CUDNN_HOME")
    return f"; TE's cuDNN {'.'.join(map(str, version))}" + (f" from {home}" if home else "")


def check_requirements(config: Config, *, training: bool = True) -> None:
    """Everything about TE that can be refused before a process group or file exists.

    Raises ``model_utils.errors.UsageError`` (one line, exit 2) for a missing TE, an
    unsupported GPU/CUDA/TE release for the recipe, or shapes FP8 GEMMs cannot take (training
    and validation micro-batches: validation runs under the same precision).
    """
    if training:
        check_training(config)
    te_numerics = config.run.fp8_numerics and config.precision.model_impl == "te"
    if training and te_numerics and importlib.util.find_spec("nvdlfw_inspect") is None:
        raise UsageError(
            "--fp8_numerics on --model_impl te reads TE's debug statistics, which need "
            "nvdlfw-inspect (a dependency of TE's pip package): pip install nvdlfw-inspect"
        )
    try:
        backend = TEBackend(config)
        backend.capability_check()
        if backend.fp8:
            backend.te_recipe  # noqa: B018  (builds the recipe: bad options fail here)
    except (TECapabilityError, ValueError) as err:
        raise UsageError(str(err)) from err
    if not backend.fp8:
        return
    for flag in ("train_batch_size", "val_batch_size"):
        problem = fp8_shape_problem(config.model, config.get(flag), recipe=backend.plan.recipe.name)
        if problem:
            raise UsageError(f"{problem} (--{flag} {config.get(flag)})")
