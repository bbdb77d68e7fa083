"""Moving weights between whole tensors and this rank's shards, one decoder layer at a time.

Shared by every path that reads or writes weights outside DCP's own load (HF import and
export, cross-layout loads): grouping by decoder layer bounds memory to one layer, and each
rank copies only its block of a full tensor into its DTensor shard, with no communication.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from model_utils.model.te_support import is_te_extra_state_key
from model_utils.precision import master_weights

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# A state-dict transform for another parameter layout (e.g. TE's fused layers); it receives a
# partial state dict (one decoder layer's tensors, or the non-layer ones) and returns the mapped
# partial state dict (te_llama.StateDictAdapter's from_hf and to_hf are two).
KeyMap = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by decoder layer index (non-layer names first, as one group), so a key map
    always sees a whole layer and memory stays bounded by one layer."""
    groups: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER_RE.search(name)
        groups.setdefault(int(match.group(1)) if match else -1, []).append(name)
    return [groups[k] for k in sorted(groups)]


def weight_tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The entries that are weights: tensors, minus FP8 bookkeeping (TE's `_extra_state`)."""
    return {
        k: v
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor) and not is_te_extra_state_key(k)
    }


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap tensor subclasses (e.g. torchao's WeightWithDynamicFloat8CastTensor) to a plain
    tensor holding the high-precision values."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def alias_groups(targets: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> first name sharing its storage (tied lm_head/embed_tokens)."""
    first: dict[tuple[int, int], str] = {}
    out: dict[str, str] = {}
    for name, tensor in targets.items():
        local = unwrapped(local_shard(tensor))
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        out[name] = first.setdefault(key, name) if local.numel() else name
    return out


def local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """This rank's block of the global tensor, as slices (all of it for a plain tensor)."""
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def check_shape(
    source: str, name: str, got: Iterable[int], target: torch.Tensor, hint: str
) -> None:
    """ValueError unless tensor `name` read from `source` has the model tensor's shape; `hint`
    says what to check (a shape mismatch means the model and the checkpoint disagree)."""
    got = tuple(got)
    if got != tuple(target.shape):
        raise ValueError(
            f"{source} {name} has shape {got} but the model expects {tuple(target.shape)}: {hint}"
        )


def require_complete(
    source: str,
    targets: Mapping[str, Any],
    loaded: set[str],
    aliases: Mapping[str, str],
    unexpected: list[str],
) -> None:
    """Every model tensor was filled (a tied alias counts as its root) and nothing was left over."""
    roots = {aliases[n] for n in loaded}
    missing = sorted(n for n in targets if n not in loaded and aliases[n] not in roots)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {_some(missing)}, "
            f"unexpected {_some(unexpected)}"
        )


def _some(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Copy this rank's shard of `full` into `target` (a DTensor shard or a plain tensor); every
    rank holds the same `full`, so no communication is needed (src_data_rank=None). Returns
    the shard as copied (before any rounding to the target's dtype)."""
    if isinstance(target, DTensor):
        full = full.to(device=target.device)
        full = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
    local_shard(target).copy_(full)
    return full


def plain_tensor(value: Any) -> Any:
    """An FP8 parameter (--fp8_weights: TE's QuantizedTensor, maybe a DTensor's shard) as its
    value in its nominal dtype (bf16), anything else as it is. The checkpoint then holds what a
    bf16 run holds: it loads with --fp8_weights on or off, reshards and converts like any
    other, and loading writes it back through TE's copy_, which quantises. The exact FP8 bytes
    come back from the fp32 masters (master_weights.requantize_from_masters)."""
    if not isinstance(value, torch.Tensor) or not master_weights.is_quantized(value):
        return value
    if not isinstance(value, DTensor):
        return value.dequantize(dtype=value.dtype)
    local = value.to_local()
    return DTensor.from_local(
        local.dequantize(dtype=local.dtype),
        device_mesh=value.device_mesh,
        placements=value.placements,
        shape=value.size(),
        stride=value.stride(),
    )
