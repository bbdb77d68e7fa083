"""Precision backends: one object per way of computing, all behind the same `--fp8` flag.

A backend (the PrecisionBackend protocol below: train.py calls it the same way for all three,
never by name) has these duties, each called at one point of the step (docs/architecture.md):
  prepare(model)              module swaps, before sharding (e.g. nn.Linear -> Float8Linear)
  autocast(first_micro_batch) context for the forward pass only; in training, whether this is a
                              step's first micro-batch (TE re-casts FP8 weights there only)
  after_optimizer_step(model) per-step bookkeeping (e.g. torchao's FP8 scale precompute for FSDP)
  cool_down(model)            FP8 off from here on (--bf16_cooldown): the step's GEMMs in the
                              compute dtype, each layer's FP8 state kept for the checkpoint
  describe()                  the startup log line
  master_weight_adam(device)  the backend's own AdamW over fp32 masters (TE: FusedAdam on CUDA)
                              for --master_weights optimizer, or None
  te_recipe                   the TE recipe object that TE layers are built and checkpointed
                              with (quantized weights, FP8 state), or None: bf16, torchao, FP8 off
  checkpoint_fn               the activation-checkpoint function its layers need, or None (torch's)
Compute dtype itself comes from FSDP2's MixedPrecisionPolicy (bf16 params for compute, fp32
master weights and gradient reduction), the way torchtitan does it, so --fp8=0 and --fp8=1 run the
same bf16 model and the comparison isolates FP8. Without FSDP2 (--sharding_strategy none) every
backend's autocast adds torch.autocast in bf16 instead, torchtitan's single-device choice. With
--master_weights optimizer the parameters are bf16 already (no cast) and the fp32 masters live in
the optimizer (model_utils/master_weights).
Transformer Engine lives in precision/te.py and is imported only when the TE implementation is
selected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from model_utils.config.fp8_plan import plan_of
from model_utils.config.machine import fp8_capable_gpu
from model_utils.config.options import TE_IMPLS
from model_utils.config.run_config import Config
from model_utils.precision.output_gemms import cool_lm_head

# FP8 GEMMs need both matrix dims divisible by 16 (the backward multiplies by the transpose).
FP8_DIM_MULTIPLE = 16


@runtime_checkable
class PrecisionBackend(Protocol):
    """What train.py, step.py and run_log.py call on a precision backend."""

    name: str

    @property
    def te_recipe(self) -> Any | None: ...

    @property
    def checkpoint_fn(self) -> Callable[..., Any] | None: ...

    def prepare(self, model: nn.Module) -> nn.Module: ...

    def autocast(
        self, first_micro_batch: bool | None = None
    ) -> contextlib.AbstractContextManager: ...

    def after_optimizer_step(self, model: nn.Module) -> None: ...

    def master_weight_adam(self, device: torch.device) -> Any | None: ...

    def cool_down(self, model: nn.Module) -> None: ...

    def describe(self) -> str: ...


def autocast_dtype(config: Config) -> torch.dtype | None:
    """What torch.autocast computes in where no FSDP2 casts the parameters (--sharding_strategy
    none with bf16); None where FSDP2's MixedPrecisionPolicy does (or fp32 throughout)."""
    unsharded = config.parallel.sharding_strategy == "none"
    return torch.bfloat16 if unsharded and config.precision.bf16 else None


class BF16:
    """No module swaps: FSDP2 computes in bf16 (or fp32 with --bf16=0), or torch.autocast does
    without FSDP2."""

    name = "bf16"
    checkpoint_fn = None
    te_recipe = None

    def __init__(self, config: Config, device: torch.device | None = None) -> None:
        self.compute = "bf16" if config.precision.bf16 else "fp32"
        self.masters = MASTERS_WHERE[config.optim.master_weights]
        self.torch_autocast_dtype = autocast_dtype(config)
        unsharded = config.parallel.sharding_strategy == "none"
        self.reduce = "no FSDP2" if unsharded else f"{config.parallel.reduce_dtype} gradient reduce"
        self.device_type = device.type if device is not None else "cpu"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self, first_micro_batch: bool | None = None) -> contextlib.AbstractContextManager:
        if self.torch_autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.torch_autocast_dtype)

    def after_optimizer_step(self, model: nn.Module) -> None:
        return None

    def master_weight_adam(self, device: torch.device) -> None:
        """No fused master-weight AdamW of its own: optim's MasterWeightAdamW runs."""
        return None

    def cool_down(self, model: nn.Module) -> None:
        """No FP8 to turn off."""
        return None

    def describe(self) -> str:
        if self.torch_autocast_dtype is not None:
            return f"precision: bf16 compute by torch.autocast, {self.masters}, no FSDP2"
        return f"precision: {self.compute} compute, {self.masters}, {self.reduce}"


#: How the start-up line names each --master_weights.
MASTERS_WHERE = {
    "params": "fp32 master weights",
    "optimizer": "bf16 parameters with fp32 master weights in AdamW",
}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class TorchaoFloat8(BF16):
    """torchao.float8: nn.Linear -> Float8Linear with dynamic scaling; emulated on CPU. The
    rest is BF16's: no TE recipe, torch's checkpointing, its autocast, no AdamW of its own."""

    name = "torchao-fp8"

    def __init__(self, config: Config, device: torch.device) -> None:
        super().__init__(config, device)
        self.plan = plan_of(config)
        # Real FP8 GEMMs need FP8 tensor cores; elsewhere torchao emulates the numerics around
        # the model's compute dtype (bf16, or fp32 with --bf16=0 on a CPU without bf16 units).
        self.emulate = device.type != "cuda" or not fp8_capable_gpu()
        self.converted: list[str] = []
        self.skipped: list[str] = []  # not FP8-eligible (lm_head, odd shapes)
        self.in_kept_layers: list[str] = []  # --bf16_layers

    def config(self):
        from torchao.float8 import Float8LinearConfig

        base = Float8LinearConfig.from_recipe_name(self.plan.recipe.name)
        return dataclasses.replace(
            base, emulate=self.emulate, enable_fsdp_float8_all_gather=self.plan.all_gather
        )

    def prepare(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        def keep(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            layer = _LAYER.search(fqn)
            if layer and int(layer.group(1)) in self.plan.kept_layers:
                self.in_kept_layers.append(fqn)
                return False
            # the output projection stays in high precision (loss is sensitive to it)
            eligible = fqn.split(".")[-1] != "lm_head" and not (
                module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE
            )
            (self.converted if eligible else self.skipped).append(fqn)
            return eligible

        return convert_to_float8_training(model, config=self.config(), module_filter_fn=keep)

    def cool_down(self, model: nn.Module) -> None:
        """From here on each Float8Linear computes as the nn.Linear it replaced, under
        torch.autocast too (without FSDP2: fp32 weights), where torchao's own backward with
        every cast disabled would multiply bf16 gradients by fp32 weights and raise. The
        weights are plain: --bf16_cooldown excludes the float8 all-gather."""
        from torchao.float8.float8_linear import Float8Linear

        for module in model.modules():
            if isinstance(module, Float8Linear):
                module.forward = types.MethodType(nn.Linear.forward, module)
        cool_lm_head(model)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if self.plan.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def describe(self) -> str:
        mode = (
            f"emulated in {self.compute} (numerics only, slower than {self.compute})"
            if self.emulate
            else "FP8 tensor cores"
        )
        plan = self.plan
        gather = ", float8 all-gather" if plan.all_gather else ""
        skipped = [n for n in self.skipped if not (plan.lm_head and n.endswith("lm_head"))]
        kept = ", ".join(skipped) if skipped else "none"
        if plan.kept_layers:
            kept += f"; {plan.kept_words} ({len(self.in_kept_layers)} linears)"
        head = "; lm_head's GEMMs in FP8 (chunked loss)" if plan.lm_head else ""
        head += f"; BF16 from step {plan.cooldown_from + 1}" if plan.cooldown_from else ""
        if self.torch_autocast_dtype is not None:
            head += "; bf16 compute by torch.autocast, no FSDP2"
        return (
            f"precision: torchao float8 {plan.recipe.name}{gather}, {mode}; "
            f"{len(self.converted)} linears in FP8, kept in {self.compute}: {kept}{head}"
        )


def build_backend(
    config: Config, device: torch.device, dp_group: object | None = None
) -> PrecisionBackend:
    """The backend for (--model_impl, --fp8). TE implementations always use the TE backend so that
    --fp8=0 runs the very same TE model in bf16."""
    plan = plan_of(config)
    if config.precision.model_impl in TE_IMPLS:
        from model_utils.precision.te import TEBackend

        numerics = plan.numerics and config.precision.model_impl == "te"
        return TEBackend(
            config,
            dp_group=dp_group,
            torch_autocast_dtype=autocast_dtype(config),
            numerics=numerics,
        )
    if plan.on:
        return TorchaoFloat8(config, device)
    return BF16(config, device)
