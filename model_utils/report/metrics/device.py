"""What the device offers and used: its dense bf16 peak (the MFU basis), peak memory, the bytes
autograd keeps for backward in each decoder layer (what AC saves), and the
sync that ends a timed window."""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Callable

import torch
from torch import nn

from model_utils.parallel import distributed

GIB = float(1 << 30)

# Device peaks and memory

# Dense (no sparsity) BF16 tensor-core peaks in TFLOP/s from NVIDIA datasheets (torchtitan's
# values, with the H200 NVL, GH200 and GB200 it folds into H200 and B200 told apart). Order
# matters: the first substring found in the device name wins.
_BF16_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 NVL", 835.0, "H100 NVL"),
    ("H100 PCIe", 756.0, "H100 PCIe"),
    ("H100", 989.0, "H100 SXM"),
    ("H200 NVL", 835.0, "H200 NVL"),
    ("GH200", 989.0, "GH200"),
    ("H200", 989.0, "H200"),
    ("A100", 312.0, "A100"),
    ("GB200", 2500.0, "GB200"),
    ("B200", 2250.0, "B200"),
)


def peak_bf16_tflops_for_name(device_name: str) -> tuple[float | None, str]:
    """Dense bf16 peak for a CUDA device name (e.g. ``"NVIDIA H100 80GB HBM3"``) and a label."""
    for needle, tflops, label in _BF16_PEAKS:
        if needle.lower() in device_name.lower():
            return tflops, f"vs {label} dense bf16 peak {tflops:g} TFLOP/s"
    return None, f"n/a: no bf16 peak known for {device_name!r}"


def peak_bf16_tflops(device: torch.device | str) -> tuple[float | None, str]:
    """``(peak TFLOP/s or None, label)``. None on CPU and on GPUs missing from the table."""
    device = torch.device(device)
    if device.type == "cuda":
        return peak_bf16_tflops_for_name(torch.cuda.get_device_name(device))
    return None, f"n/a on {device.type}"


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory so far: CUDA ``max_memory_allocated`` on GPU, process max RSS elsewhere.

    The two are different quantities (tensor allocations vs the whole process, including
    Python, libraries and the data pipeline); :func:`peak_memory_label` says which one it is.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)


def peak_memory_label(device: torch.device | str) -> str:
    device = torch.device(device)
    return "cuda max allocated" if device.type == "cuda" else "process max RSS"


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for every kernel queued on ``device`` (a no-op on CPU, where work
    runs as it is issued). The step meter calls it at the two ends of every timed window."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# Activation memory


def kept_activation_bytes(
    model: nn.Module,
    batch: torch.Tensor,
    part: Callable[[nn.Module], nn.Module] = lambda layer: layer,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward while inside each decoder layer (or the ``part`` of
    it given), and the loss of that forward (backward not run). ``autocast``: the precision
    backend's, so TE runs its FP8 GEMMs as in training.

    Saved views of the gathered parameters are left out: FSDP2 frees that storage after the
    forward (and gathers it again for backward), so they are not activations."""
    inside, kept = [False], [0]
    weights: set[int] = set()

    def enter(module: nn.Module, *_: object) -> None:
        inside[0] = True
        weights.clear()
        weights.update(p.untyped_storage().data_ptr() for p in module.parameters())

    hooks = []
    for layer in distributed.decoder_layers(model):
        hooks.append(part(layer).register_forward_pre_hook(enter))
        hooks.append(part(layer).register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage().data_ptr() not in weights:
            kept[0] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            loss = model(input_ids=batch, labels=batch).loss
    finally:
        for hook in hooks:
            hook.remove()
    return kept[0], loss
