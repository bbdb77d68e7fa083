"""What the precision stage does to a Transformer Engine model's modules: tell them which
micro-batch starts a step, and carry their delayed-scaling FP8 state as plain tensors (for
checkpoints, and put back after a validation forward).

Importing this module never imports TE; the TE modules it handles are recognised by their
attributes (``fp8_meta``, ``init_fp8_meta_tensors``, ``te_is_first_microbatch``), not their
classes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from model_utils.parallel.distributed import canonical_param_name

#: Per-module flag read by the TE modules that take ``is_first_microbatch`` (te_llama sets it on
#: its decoder layers and on the ``te.Linear`` it swaps in).
FIRST_MICROBATCH_ATTR = "te_is_first_microbatch"


def te_modules(model: nn.Module) -> Iterator[nn.Module]:
    """TE modules that take ``is_first_microbatch``: te_llama's decoder layers and swapped
    linears, both marked by :data:`FIRST_MICROBATCH_ATTR` in their own ``__dict__`` (not
    ``hasattr``: activation checkpointing's wrapper forwards attribute reads to what it wraps)."""
    for module in model.modules():
        if FIRST_MICROBATCH_ATTR in vars(module):
            yield module


def set_is_first_microbatch(model: nn.Module, value: bool | None) -> None:
    """Tell TE whether the next forward starts a new optimizer step (True), continues gradient
    accumulation (False), or is outside training (None: no FP8 weight caching)."""
    for module in te_modules(model):
        setattr(module, FIRST_MICROBATCH_ATTR, value)


# ---- FP8 scaling state as plain tensors (what TE pickles into ``_extra_state``)

#: Per TE module and direction, the delayed-scaling tensors TE keeps in
#: ``fp8_meta["scaling_fwd" | "scaling_bwd"]`` (``.scale`` [n], ``.amax_history`` [len, n]; n is 3
#: per GEMM forward and 2 backward). Current, block and MXFP8 scaling keep no state.
FP8_DIRECTIONS = ("fwd", "bwd")
RECIPE_KEY = "recipe"


def _fp8_stateful_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """TE modules (anything with TE's ``fp8_meta`` and ``init_fp8_meta_tensors``), by clean name."""
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if isinstance(meta, dict) and hasattr(module, "init_fp8_meta_tensors"):
            yield canonical_param_name(name), module


def recipe_identity(recipe: Any) -> dict[str, Any]:
    """The recipe class and the fields that shape its scaling state, as JSON-able values."""
    identity: dict[str, Any] = {"class": type(recipe).__name__}
    for field in ("fp8_format", "amax_history_len", "amax_compute_algo", "margin"):
        value = getattr(recipe, field, None)
        if value is not None:
            identity[field] = getattr(value, "name", value) if not callable(value) else "custom"
    return identity


def _json_tensor(payload: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(list(json.dumps(payload, sort_keys=True).encode()), dtype=torch.uint8)


def decode_recipe_identity(tensor: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(tensor.cpu().tolist()).decode())


def fp8_scaling_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every TE module's delayed-scaling state as plain tensors: ``<module>.scale_fwd``,
    ``amax_history_fwd``, ``scale_bwd``, ``amax_history_bwd`` and ``<module>.recipe`` (the
    recipe's identity as UTF-8 JSON bytes).

    TE's own ``_extra_state`` pickles these with the recipe object, and TE >= 2.18 refuses to
    unpickle that (it could run code) unless the user sets an unsafe variable; plain tensors
    need no trust decision and load on every TE release. Between steps every rank holds the
    same values, so one copy is saved: TE all-reduces the forward amaxes when the forward's
    autocast exits and the backward ones when backward ends, and validation puts its amaxes
    back (:func:`fp8_scaling_kept`). The one exception is harmless: with FP8 weights under
    delayed scaling, TE's FusedAdam leaves each rank's weight-shard amax in the current row
    for the next forward's MAX reduction. A resume gives every rank rank 0's, and
    ``requantize_from_masters`` records each rank's own again; the reduction's maximum over
    all ranks already includes rank 0's, so it comes out the same.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in _fp8_stateful_modules(model):
        meta = module.fp8_meta
        recipe = meta.get("recipe")
        if recipe is None or not recipe.delayed() or "scaling_fwd" not in meta:
            continue
        prefix = f"{name}." if name else ""
        for direction in FP8_DIRECTIONS:
            state = meta[f"scaling_{direction}"]
            out[f"{prefix}scale_{direction}"] = state.scale
            out[f"{prefix}amax_history_{direction}"] = state.amax_history
        out[prefix + RECIPE_KEY] = _json_tensor(recipe_identity(recipe))
    return out


def _restore_recipes(recipe: Any, saved: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """The recipe a module's saved state goes back under and what TE's ``init_fp8_meta_tensors``
    is given for it, or None where this run keeps no such state. Under current scaling with
    ``fp8_dpa`` TE's DotProductAttention runs S and dP on a delayed-scaling recipe of its own (its
    [current, delayed] splice in ``init_fp8_metadata``); that state goes back under the saved
    knobs, which TE's first forward keeps (it only resizes the history to its own)."""
    if recipe.delayed():
        return recipe, recipe
    if not getattr(recipe, "fp8_dpa", False) or saved.get("class") != "DelayedScaling":
        return None
    delayed = importlib.import_module(type(recipe).__module__).DelayedScaling
    knobs = ("amax_history_len", "amax_compute_algo", "margin")
    own = delayed(fp8_format=recipe.fp8_format, fp8_dpa=True, **{k: saved[k] for k in knobs})
    return own, [recipe, own]


@torch.no_grad()
def load_fp8_scaling_state(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], recipe: Any
) -> list[str]:
    """Put :func:`fp8_scaling_state` tensors back into the TE modules that keep such state under
    ``recipe``; returns the names of the modules restored (a changed knob is the resume
    rules' to refuse or log: config/flag_spec's FP8_KNOB).

    Does what TE's ``set_extra_state`` does after unpickling: set the recipe and GEMM count,
    let TE allocate its recipe state, then copy scales and histories in place (TE's amax
    reduction buffers view these very tensors). A history saved with another
    ``--amax_history_len`` is cut or zero-padded, as TE resizes it.
    """
    restored = []
    for name, module in _fp8_stateful_modules(model):
        prefix = f"{name}." if name else ""
        if f"{prefix}scale_fwd" not in tensors:
            continue
        recipes = _restore_recipes(recipe, decode_recipe_identity(tensors[prefix + RECIPE_KEY]))
        if recipes is None:
            continue
        meta = module.fp8_meta
        meta["recipe"] = recipes[0]
        meta["num_gemms"] = tensors[f"{prefix}scale_fwd"].numel() // 3
        meta["fp8_checkpoint"] = True
        module.init_fp8_meta_tensors(recipes[1])
        for direction in FP8_DIRECTIONS:
            state = meta[f"scaling_{direction}"]
            state.scale.copy_(tensors[f"{prefix}scale_{direction}"])
            saved = tensors[f"{prefix}amax_history_{direction}"]
            rows = min(saved.shape[0], state.amax_history.shape[0])
            state.amax_history.zero_()
            state.amax_history[:rows].copy_(saved[:rows])
        restored.append(name)
    return restored


@contextlib.contextmanager
def fp8_scaling_kept(model: nn.Module) -> Iterator[None]:
    """An inference forward under FP8 autocast that leaves training's delayed-scaling state as
    it found it.

    TE records an inference forward's amaxes in row 0 of every history, but reduces and
    updates nothing when an autocast exits with grad disabled (``autocast_exit``). Left there,
    they would wait, different on each rank, for the next training forward, so validation
    would move training's scales; and a checkpoint saved after a validation would hold one
    rank's unreduced row, so a multi-GPU resume would not repeat the run. Restored here: the
    histories and scales are small (5 floats per GEMM per history row).
    """
    before = {k: v.clone() for k, v in _scaling_tensors(model).items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for key, live in _scaling_tensors(model).items():
                if key in before:
                    live.copy_(before[key])
                else:  # a module whose first FP8 forward was this one: back to TE's fresh state
                    live.fill_(1.0 if key.rsplit(".", 1)[-1].startswith("scale") else 0.0)


def _scaling_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`fp8_scaling_state` without the recipes: the scales and histories TE updates."""
    state = fp8_scaling_state(model)
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] != RECIPE_KEY}
