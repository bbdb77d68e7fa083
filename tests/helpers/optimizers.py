"""Optimizer helpers: AdamW's betas, parameter groups by decay, torchao's low-bit states."""

from __future__ import annotations

import torch

#: AdamW's betas in the master-weight and FP8-weight optimizer tests.
BETAS = (0.9, 0.95)


def group_names(groups: list[dict]) -> tuple[set[str], set[str]]:
    """The parameter names of the groups with weight decay, and of those without."""
    by_decay = {g["weight_decay"] > 0: set(g["param_names"]) for g in groups}
    return by_decay.get(True, set()), by_decay.get(False, set())


#: torchao's low-bit AdamWs (--optimizer) and the class of their quantized moments.
LOW_BIT = ("adamw8bit", "adamw_fp8")
STATE_CLASS = {"adamw8bit": "OptimState8bit", "adamw_fp8": "OptimStateFp8"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a moment, dequantized if torchao quantized it, as float."""
    local = local_tensor(t)
    return local.dequantize() if hasattr(local, "dequantize") else local.float()
