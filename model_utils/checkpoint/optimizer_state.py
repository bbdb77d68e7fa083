"""Optimizer state as saved: its fields, whether it converts through the weight mapping, and
whether torchao's block-quantized state survives a reshard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from model_utils.checkpoint.errors import ResumeRefused
from model_utils.checkpoint.ranks import all_gather_object, world_size
from model_utils.checkpoint.saved import load_local, saved_tensors
from model_utils.checkpoint.tensors import local_index, local_shard

_OPT_STATE = "optimizer.state."
_OPT_GROUPS = "optimizer.param_groups."
# Per-group entries that name parameters (they follow the model's layout, not the checkpoint's).
_GROUP_PARAM_KEYS = ("params", "param_names")


def optimizer_fields(metadata: Any) -> dict[str, dict[str, tuple[str, Any]]]:
    """Saved optimizer state by field (exp_avg, exp_avg_sq, step, ...): {param FQN: entry}."""
    fields: dict[str, dict[str, tuple[str, Any]]] = {}
    for key, entry in saved_tensors(metadata, _OPT_STATE).items():
        fqn, _, name = key.rpartition(".")
        fields.setdefault(name, {})[fqn] = entry
    return fields


def moment_conversion_problem(
    fields: Mapping[str, Mapping[str, tuple[str, Any]]],
    param_shapes: Mapping[str, tuple[int, ...]],
    target_fields: Iterable[str],
) -> str | None:
    """Why saved optimizer state cannot be converted through the parameter mapping, or None.

    Convertible: this optimizer keeps the same fields, every parameter has each of them, and
    each field is shaped like its parameter for every parameter (Adam's exp_avg/exp_avg_sq:
    they concatenate and split exactly like the weights) or is a scalar (Adam's step)."""
    if not fields:
        return "the checkpoint holds no optimizer state"
    if set(fields) != set(target_fields):
        return (
            f"saved optimizer fields {sorted(fields)} != this optimizer's {sorted(target_fields)}"
        )
    for field_name, per_param in fields.items():
        if set(per_param) != set(param_shapes):
            return f"optimizer state {field_name!r} is not kept for every parameter"
        shapes = [(tuple(md.size), param_shapes[fqn]) for fqn, (_, md) in per_param.items()]
        if not (all(s == p for s, p in shapes) or all(s == () for s, _ in shapes)):
            return f"optimizer state {field_name!r} is neither parameter-shaped nor a scalar"
    return None


# torchao/optim/adam.py `_AdamBase._new_buffer`: a state shard is quantized only when it holds at
# least this many values and a whole number of blocks; smaller ones stay plain fp32 tensors.
_TORCHAO_MIN_QUANTIZED = 4096


def is_quantized_state(tensor: torch.Tensor) -> bool:
    """torchao's OptimState8bit / OptimStateFp8 (a wrapper subclass with a block size)."""
    local = local_shard(tensor)
    return is_traceable_wrapper_subclass(local) and hasattr(local, "block_size")


def low_bit_reshard_problem(metadata: Any, model: nn.Module, optimizer: Any) -> str | None:
    """Why this rank cannot load torchao's block-quantized optimizer state on this world size,
    or None (always None for optimizers without torchao's ``block_size``).

    A resharded DCP load cuts each saved shard where this rank's shard starts or ends, and
    writes into this rank's shard where a saved shard starts or ends. torchao's OptimState8bit
    and OptimStateFp8 can be cut only along dim 0 and only between blocks (their `aten.slice`
    in torchao/optim/subclass_8bit.py and subclass_fp8.py raises "Make sure start and end align
    with block boundary" otherwise), and a shard is quantized only when it holds >= 4096 values,
    a multiple of the block (`_new_buffer` in torchao/optim/adam.py). On the Llama presets every
    row is whole blocks (hidden and intermediate sizes are multiples of 256), so any world size
    works; a shape such as the tiny preset's 688-wide down_proj on 3 ranks does not."""
    block = getattr(optimizer, "block_size", None)
    if not isinstance(block, int):
        return None

    states = get_optimizer_state_dict(model, optimizer)["state"]  # creates the lazy state
    for field_name, per_param in optimizer_fields(metadata).items():
        for fqn, (_, md) in per_param.items():
            target = states.get(fqn, {}).get(field_name)
            if target is None or len(md.size) == 0:
                continue
            shape = tuple(md.size)
            stride = math.prod(shape[1:])
            rows = local_index(target)[0]
            t0, t1 = rows.start, rows.stop
            target_quantized = is_quantized_state(target)
            for chunk in md.chunks:
                s0, s1 = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
                o0, o1 = max(s0, t0), min(s1, t1)
                if o0 >= o1:
                    continue
                numel = math.prod(chunk.sizes)
                saved_quantized = numel >= _TORCHAO_MIN_QUANTIZED and numel % block == 0
                cuts = []  # (first row of the quantized shard, row where it is cut)
                if saved_quantized and (o0, o1) != (s0, s1):
                    cuts += [(s0, o0), (s0, o1)]
                if target_quantized and (o0, o1) != (t0, t1):
                    cuts += [(t0, o0), (t0, o1)]
                bad = [row for start, row in cuts if (row - start) * stride % block]
                if bad:
                    return (
                        f"torchao keeps optimizer state {fqn} ({field_name}, shape {shape}) in "
                        f"blocks of {block} values and cuts it only between blocks "
                        "(aten.slice in torchao/optim/subclass_8bit.py, subclass_fp8.py), but "
                        f"the shard boundary at row {bad[0]} falls inside a block"
                    )
    return None


@torch.no_grad()
def load_param_group_hyperparameters(path: Path, metadata: Any, optimizer: Any) -> bool:
    """Restore each saved param group's lr, initial_lr, betas, weight decay, ... exactly as a
    same-layout load would (so the LR schedule continues from the saved lr); the parameter lists
    keep this model's names. False (nothing restored) if the group counts differ. torchao's
    optimizers hold lr (and so initial_lr) as 0-d tensors: those are read as tensors and filled
    in place, so the group keeps the tensor its optimizer requires."""
    saved = metadata.state_dict_metadata
    saved_groups = {k[len(_OPT_GROUPS) :].split(".")[0] for k in saved if k.startswith(_OPT_GROUPS)}
    if len(saved_groups) != len(optimizer.param_groups):
        return False
    wanted = {
        f"{_OPT_GROUPS}{i}.{name}": (i, name)
        for i, group in enumerate(optimizer.param_groups)
        for name in group
        if name not in _GROUP_PARAM_KEYS and f"{_OPT_GROUPS}{i}.{name}" in saved
    }
    values: dict[str, Any] = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        if isinstance(md := saved[key], TensorStorageMetadata)
        else None
        for key in wanted
    }
    if values:
        load_local(values, path)
    for key, (i, name) in wanted.items():
        group, value = optimizer.param_groups[i], values[key]
        if isinstance(group[name], torch.Tensor) and isinstance(value, torch.Tensor):
            group[name].copy_(value)
        else:
            group[name] = value.item() if isinstance(value, torch.Tensor) else value
    return True


def refuse_low_bit_reshard(path: Path, metadata: Any, state: Any, saved_world_size: int) -> None:
    """ResumeRefused on every rank if any rank's torchao optimizer state would be cut inside a
    quantization block by this world size."""
    problem = low_bit_reshard_problem(metadata, state.model, state.optimizer)
    problem = next((p for p in all_gather_object(problem) if p), None)
    if problem:
        raise ResumeRefused(
            f"checkpoint {path} was saved by {saved_world_size} ranks and cannot load "
            f"on {world_size()}: {problem}; resume on {saved_world_size} ranks, or on "
            "a count whose shards hold whole blocks"
        )
