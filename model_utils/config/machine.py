"""What this machine can run, asked while the flags are resolved: an FP8-capable GPU, and with
it Transformer Engine, decide what ``--model_impl auto`` means (and so the FP8 recipe's default).

A question about the machine, not about precision or the model: the config stage answers it
without importing either (the precision backends ask ``fp8_capable_gpu`` too).
"""

from __future__ import annotations

import torch

from model_utils.config.te_loader import te_available


def fp8_capable_gpu() -> bool:
    """Hopper/Ada (SM 8.9+) or newer: the GPUs with FP8 tensor cores."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def resolve_model_impl(requested: str) -> str:
    """`auto` means TE's TransformerLayer where TE can run, stock HF elsewhere."""
    if requested != "auto":
        return requested
    return "te" if fp8_capable_gpu() and te_available() else "hf"


def why_not_te() -> str:
    """Why `auto` chose hf here, for a refusal the user's flags meet only because of it."""
    if not fp8_capable_gpu():
        return "no FP8-capable GPU (Hopper or Ada) is visible"
    return "Transformer Engine does not import (--model_impl te says why)"


def has_cuda() -> bool:
    """A CUDA GPU this process can use (what CUDA-only flags need)."""
    return torch.cuda.is_available()
