"""Loading a checkpoint saved in another parameter layout (hf/te_linear <-> te).

--model_impl hf and te_linear share Hugging Face parameter names; te fuses each decoder layer
(QKV in one weight, gate/up in fc1). Each decoder layer is read whole into plain tensors (DCP
assembles them from the saved shards), mapped by a ``te_llama.StateDictAdapter``, and each rank
copies its block into its DTensor shards, so no rank holds more than one layer. AdamW's moments
have their parameter's shape and go through the same mapping. TE's `_extra_state` (FP8 scaling
history) belongs to TE's module structure and is not converted: it starts fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from model_utils.checkpoint.optimizer_state import (
    is_quantized_state,
    load_param_group_hyperparameters,
    moment_conversion_problem,
    optimizer_fields,
)
from model_utils.checkpoint.saved import MODEL_PREFIX, read_full_tensors, saved_tensors
from model_utils.checkpoint.stateful import TrainState
from model_utils.checkpoint.tensors import (
    KeyMap,
    alias_groups,
    check_shape,
    layer_groups,
    local_index,
    local_shard,
    require_complete,
    weight_tensors,
)
from model_utils.model.te_support import TE_LAYER_ATTR

log = logging.getLogger(__name__)


def param_layout(names: Iterable[str]) -> str:
    """'te' if the parameter names are the TE TransformerLayer layout of --model_impl te (fused
    QKV and fc1), else 'hf': Hugging Face names, shared by --model_impl hf and te_linear (whose
    te.Linear keeps `weight`; only its `_extra_state` entries are extra)."""
    segment = f".{TE_LAYER_ATTR}."
    return "te" if any(segment in name for name in names) else "hf"


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
    aliases = alias_groups(targets)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for group in layer_groups(saved):
        full = read_full_tensors(path, {n: saved[n] for n in group})
        for name, tensor in key_map(full).items():
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            source = f"checkpoint {path}: converted {what}"
            check_shape(source, name, tensor.shape, target, "does the model shape match?")
            local_shard(target).copy_(tensor[local_index(target)])
            loaded.add(name)
    require_complete(f"checkpoint {path}: converted {what}", targets, loaded, aliases, unexpected)
    return len(loaded)


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
    path: Path,
    metadata: Any,
    state: TrainState,
    saved_layout: str,
    adapter: Any,
    saved_impl: str = "?",
) -> None:
    """Load model weights and optimizer state saved in another parameter layout (all ranks).

    No rank ever holds more than one decoder layer in full: each layer's saved tensors are read
    whole (DCP assembles them from the saved shards, whatever the saved world size), converted
    by `adapter` (a te_llama.StateDictAdapter for the model's config), and each rank copies its
    own block into its DTensor shards. TE's `_extra_state` (FP8 scaling history) is tied to TE's
    module structure and is not converted: FP8 metadata starts fresh, as after --init_from_hf."""
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
