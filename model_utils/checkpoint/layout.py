"""Weights outside DCP's own load: whole tensors <-> this rank's shards one decoder layer at a
time, a saved checkpoint's tensors read whole, optimizer state as saved, and loading a
checkpoint saved in the other parameter layout (hf/te_linear <-> te).

Grouping by decoder layer bounds memory to one layer, and each rank copies only its block of a
full tensor into its DTensor shard, with no communication (HF import and export use it too).
--model_impl hf and te_linear share Hugging Face parameter names; te fuses each decoder layer
(QKV in one weight, gate/up in fc1): each layer is read whole (DCP assembles it from the saved
shards), mapped by a ``te_llama.StateDictAdapter``, and each rank keeps its block. AdamW's
moments have their parameter's shape and go through the same mapping. TE's `_extra_state` (FP8
scaling history) belongs to TE's module structure and is not converted: it starts fresh.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from model_utils.checkpoint.manifest import ResumeRefused, load, read_metadata
from model_utils.config.families import TE_LAYER_ATTR
from model_utils.model.te_support import is_te_extra_state_key
from model_utils.parallel.distributed import (  # the local-shard helpers: re-exported here
    first_problem,
    local_index,
    local_shard,
    unwrapped,
    world_size,
)
from model_utils.precision import master_weights

log = logging.getLogger(__name__)

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


def alias_groups(targets: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> first name sharing its storage (tied lm_head/embed_tokens)."""
    first: dict[tuple[int, int], str] = {}
    out: dict[str, str] = {}
    for name, tensor in targets.items():
        local = unwrapped(local_shard(tensor))
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        out[name] = first.setdefault(key, name) if local.numel() else name
    return out


class BlockCopy:
    """Copies this rank's block of each source (a whole tensor, or a safetensors lazy slice, which
    reads only that block) into its target (a DTensor shard or a plain tensor), with no
    communication, group after group, then checks that every target was filled. A shape
    mismatch (the model and the checkpoint disagree) is a ValueError naming `source` and `hint`,
    what to check."""

    def __init__(self, targets: Mapping[str, torch.Tensor], source: str, hint: str) -> None:
        self.targets, self.source, self.hint = targets, source, hint
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []  # sources without a target

    @torch.no_grad()
    def copy(self, sources: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Copy one group of sources; returns the blocks as read (before any rounding to the
        target's dtype)."""
        copied = {}
        for name, tensor in sources.items():
            target = self.targets.get(name)
            if target is None:
                self.unexpected.append(name)
                continue
            shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
            if shape != tuple(target.shape):
                raise ValueError(
                    f"{self.source} {name} has shape {shape} but the model expects "
                    f"{tuple(target.shape)}: {self.hint}"
                )
            copied[name] = tensor[local_index(target)]
            local_shard(target).copy_(copied[name])
            self.loaded.add(name)
        return copied

    def require_complete(self, source: str | None = None) -> int:
        """Every model tensor was filled (a tied alias counts as its root) and nothing was left
        over, else a ValueError naming `source` (default: the copies' source); the count copied."""
        aliases = alias_groups(self.targets)
        roots = {aliases[n] for n in self.loaded}
        missing = sorted(n for n in self.targets if aliases[n] not in roots)
        if missing or self.unexpected:
            raise ValueError(
                f"{source or self.source} does not match the model: missing {_some(missing)}, "
                f"unexpected {_some(self.unexpected)}"
            )
        return len(self.loaded)


def _some(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


def plain_tensor(value: Any) -> Any:
    """An FP8 parameter (--fp8_weights: TE's QuantizedTensor, maybe a DTensor's shard) as its
    value in its nominal dtype (bf16); torchao's float8 all-gather wrapper (--fp8_all_gather)
    as the tensor it wraps (the same storage, so a load lands in the parameter); anything else
    as it is. The checkpoint then holds what a bf16 run holds: it loads with either flag on or
    off, on a GPU or an emulating CPU, reshards and converts like any other; loading writes a
    TE parameter back through TE's copy_, which quantises, and the exact FP8 bytes come back
    from the fp32 masters (master_weights.requantize_from_masters)."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    if master_weights.is_quantized(value):
        plain = local.dequantize(dtype=local.dtype)
    elif hasattr(local, "_linear_mm_config"):  # torchao's WeightWithDynamicFloat8CastTensor
        plain = local._tensor
    else:
        return value
    if not isinstance(value, DTensor):
        return plain
    return DTensor.from_local(
        plain,
        device_mesh=value.device_mesh,
        placements=value.placements,
        shape=value.size(),
        stride=value.stride(),
    )


# --------------------------------------------------------------------------------------------
# A saved checkpoint's tensors, read whole in one process (no_dist: each rank, or a script
# without a process group, reads only what it asks for, without collectives)

MODEL_PREFIX = "model."


def saved_tensors(metadata: Any, prefix: str) -> dict[str, tuple[str, Any]]:
    """Saved tensors under DCP key `prefix` (TE extra state excluded), by name without the
    prefix: name -> (DCP key, TensorStorageMetadata)."""
    return {
        key[len(prefix) :]: (key, md)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and not is_te_extra_state_key(key)
    }


def read_full_tensors(path: Path, entries: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Whole saved tensors on CPU (DCP assembles them from every saved shard). no_dist: each rank
    reads on its own, without collectives, so ranks need not request the same keys."""
    out = {n: torch.empty(md.size, dtype=md.properties.dtype) for n, (_, md) in entries.items()}
    if out:
        load_local({key: out[n] for n, (key, _) in entries.items()}, path)
    return out


def load_local(request: dict[str, Any], path: Path) -> None:
    """dcp.load in this process only (no_dist), without DCP's single-process warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(request, path, no_dist=True)


def iter_dcp_model_layers(path: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model tensors of a DCP checkpoint, one decoder layer at a time, in one process; a
    parameter the optimizer kept an fp32 master of (--master_weights optimizer) as that master,
    as --export_hf writes it (the parameter is the master rounded to bf16 or FP8)."""
    metadata = read_metadata(path)
    entries = saved_tensors(metadata, MODEL_PREFIX)
    masters = optimizer_fields(metadata).get("master_param", {})
    for group in layer_groups(entries):
        yield read_full_tensors(Path(path), {n: masters.get(n, entries[n]) for n in group})


# --------------------------------------------------------------------------------------------
# Optimizer state as saved: its fields, whether it converts through the weight mapping, and
# whether torchao's block-quantized state survives a reshard

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
    problem = first_problem(low_bit_reshard_problem(metadata, state.model, state.optimizer))
    if problem:
        raise ResumeRefused(
            f"checkpoint {path} was saved by {saved_world_size} ranks and cannot load "
            f"on {world_size()}: {problem}; resume on {saved_world_size} ranks, or on "
            "a count whose shards hold whole blocks"
        )


# ---- Loading a checkpoint saved in the other parameter layout


def param_layout(names: Iterable[str]) -> str:
    """'te' if the parameter names are the TE TransformerLayer layout of --model_impl te (fused
    QKV and fc1), else 'hf': Hugging Face names, shared by --model_impl hf and te_linear (whose
    te.Linear keeps `weight`; only its `_extra_state` entries are extra)."""
    segment = f".{TE_LAYER_ATTR}."
    return "te" if any(segment in name for name in names) else "hf"


def other_layout(metadata: Any, model: nn.Module) -> str | None:
    """The saved parameter layout when it differs from `model`'s (a load converts it), or None."""
    saved = param_layout(saved_tensors(metadata, MODEL_PREFIX))
    return saved if saved != param_layout(get_model_state_dict(model)) else None


@torch.no_grad()
def copy_converted(
    path: Path,
    saved: Mapping[str, tuple[str, Any]],
    key_map: KeyMap,
    targets: Mapping[str, torch.Tensor],
    what: str,
) -> int:
    """Read `saved` (name -> DCP key, metadata) one decoder layer at a time, convert it with
    `key_map`, and copy this rank's block of each converted tensor into `targets` (DTensor
    shards or plain tensors). Memory: one layer of full tensors. Returns the tensors copied;
    ValueError if the converted names or shapes do not match the targets."""
    blocks = BlockCopy(
        targets, f"checkpoint {path}: converted {what}", "does the model shape match?"
    )
    for group in layer_groups(saved):
        blocks.copy(key_map(read_full_tensors(path, {n: saved[n] for n in group})))
    return blocks.require_complete()


@torch.no_grad()
def load_converted_optimizer(
    path: Path, metadata: Any, model: nn.Module, optimizer: Any, key_map: KeyMap
) -> str:
    """Convert the saved optimizer state to this model's layout; returns what happened (logged).

    Adam's moments have their parameter's shape, so the weights' mapping converts them
    (a fused QKV moment is the concatenation of the q, k and v moments, exactly as if the fused
    parameter had been trained); `step` is the same count for every parameter (the largest saved
    one is used). State that does not fit this scheme (another optimizer) restarts from zero:
    the weights and schedule still resume, only the moments are rebuilt by the next steps."""
    params = {n: tuple(md.size) for n, (_, md) in saved_tensors(metadata, MODEL_PREFIX).items()}
    fields = optimizer_fields(metadata)
    osd = get_optimizer_state_dict(model, optimizer)  # creates AdamW's lazy state
    entries = list(osd["state"].values())
    problem = moment_conversion_problem(fields, params, entries[0] if entries else ())
    if problem is None:
        for field_name, per_param in fields.items():
            if all(len(md.size) == 0 for _, md in per_param.values()):
                saved_values = read_full_tensors(path, per_param).values()
                largest = max(saved_values, key=lambda t: t.item())
                for entry in entries:
                    entry[field_name].copy_(largest)
                continue
            targets = {fqn: entry[field_name] for fqn, entry in osd["state"].items()}
            copy_converted(path, per_param, key_map, targets, f"optimizer {field_name}")
        set_optimizer_state_dict(model, optimizer, osd)
        outcome = f"optimizer state ({', '.join(sorted(fields))}) converted"
        if any(is_quantized_state(v) for entry in entries for v in entry.values()):
            outcome += " (torchao's blocks re-quantized in this layout: close, not bit for bit)"
    else:
        optimizer.state.clear()  # fresh moments and step: AdamW re-creates them at the next step
        outcome = f"optimizer moments restart from zero ({problem})"
    if not load_param_group_hyperparameters(path, metadata, optimizer):
        outcome += "; param groups differ in number, so their lr/betas/decay are this run's"
    return outcome


@torch.no_grad()
def load_converted(
    path: Path, metadata: Any, state: Any, saved_layout: str, adapter: Any, saved_impl: str
) -> None:
    """Load model weights and optimizer state saved in another parameter layout (all ranks),
    mapped by `adapter` (a te_llama.StateDictAdapter for the model's config) one decoder layer
    at a time, whatever the saved world size; FP8 metadata starts fresh, as after
    --init_from_hf (see the module's docstring)."""
    targets = weight_tensors(get_model_state_dict(state.model))
    layout = param_layout(targets)
    if adapter is None:
        raise ValueError(
            f"checkpoint {path} has the {saved_layout!r} parameter layout, this model the "
            f"{layout!r} one: converting needs the Checkpointer's state_dict_adapter"
        )
    key_map = adapter.converter(saved_layout, layout)
    count = copy_converted(path, saved_tensors(metadata, MODEL_PREFIX), key_map, targets, "weight")
    outcome = "no optimizer"
    if state.optimizer is not None:
        outcome = load_converted_optimizer(path, metadata, state.model, state.optimizer, key_map)
    log.warning(
        "Checkpoint %s was saved by --model_impl %s (%s parameter layout); this model has the %s "
        "layout: %d weights converted through te_llama's mapping one decoder layer at a time; "
        "%s; Transformer Engine FP8 metadata starts fresh",
        path,
        saved_impl,
        saved_layout,
        layout,
        count,
        outcome,
    )
