"""Transformer Engine glue the library needs without the model file: import, FP8 state, hooks.

``te_llama.py`` (repo root) is the model: it builds the TE decoder and owns the HF <-> TE
weight table. What ``model_utils`` itself must do with TE modules lives here, so no package
module imports upward from the root: import TE (one importer, one error), tell TE which
micro-batch starts a step, materialise TE parameters after ``to_empty``, recognise TE's extra
state in a state dict, and carry delayed-scaling FP8 state as plain tensors for checkpoints.

Importing this module never imports TE; the TE modules it handles are recognised by their
attributes (``fp8_meta``, ``param_init_meta``, ``te_is_first_microbatch``), not their classes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model_utils.parallel.distributed import canonical_param_name
from model_utils.precision.te_loader import align_te_cudnn

#: Attribute of te_llama's decoder layer holding the TE ``TransformerLayer``: a parameter name
#: containing it belongs to the fused ``te`` layout (QKV in one weight, gate/up in ``fc1``).
TE_LAYER_ATTR = "transformer_layer"
#: Per-module flag read by the TE modules that take ``is_first_microbatch`` (te_llama sets it on
#: its decoder layers and on the ``te.Linear`` it swaps in).
FIRST_MICROBATCH_ATTR = "te_is_first_microbatch"


class TEUnavailableError(ImportError):
    """Transformer Engine is not importable here (it needs an NVIDIA GPU build, e.g. NGC)."""


def import_te() -> ModuleType:
    """Return ``transformer_engine.pytorch`` or raise a one-line, actionable error.

    TE is first pointed at the cuDNN torch runs on (``te_loader``): it loads its own at import.
    """
    try:
        align_te_cudnn()
        return importlib.import_module("transformer_engine.pytorch")
    # OSError: TE opens its CUDA libraries with ctypes, which raises it (e.g. a system cuDNN
    # sub-library that does not match the cuDNN already open: "undefined symbol")
    except (ImportError, OSError) as err:
        raise TEUnavailableError(
            "Transformer Engine is not available (import transformer_engine.pytorch failed: "
            f"{err}). Use --model_impl hf, or run inside the NGC PyTorch container built by "
            "0.transformer-engine.dockerfile."
        ) from err


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (used by ``--model_impl auto``)."""
    try:
        import_te()
    except TEUnavailableError:
        return False
    return True


def is_te_extra_state_key(key: str) -> bool:
    """TE modules add ``<module>._extra_state`` (FP8 scaling metadata) to their state dict.

    It is bookkeeping, not a weight: weights converted from HF have none (TE starts fresh FP8
    statistics, as after a change of recipe), and checkpoints store it as plain tensors instead.
    """
    return key.endswith("._extra_state") or key == "_extra_state"


# --------------------------------------------------------------------------------------------
# Gradient accumulation and initialisation hooks.
# --------------------------------------------------------------------------------------------


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


def reset_te_parameters(model: nn.Module) -> None:
    """Let TE modules build their real parameters; call after ``to_empty``, before init.

    Every TE module exposes ``reset_parameters(defer_init=False)``, which materialises meta
    parameters, runs TE's init and, under ``quantized_model_init`` (``--fp8_weights``), turns
    them into FP8 tensors (``to_empty`` alone leaves plain high-precision tensors). A
    deterministic init afterwards writes through ``copy_``, which TE quantizes.
    """
    for module in model.modules():
        if hasattr(module, "param_init_meta") and hasattr(module, "reset_parameters"):
            module.reset_parameters(defer_init=False)


# --------------------------------------------------------------------------------------------
# FP8 scaling state as plain tensors (what TE pickles into ``_extra_state``).
# --------------------------------------------------------------------------------------------

#: Per TE module and direction, the delayed-scaling tensors TE keeps in
#: ``fp8_meta["scaling_fwd" | "scaling_bwd"]`` (``.scale`` [n], ``.amax_history`` [len, n]; n is 3
#: per GEMM forward and 2 backward). Current, block and MXFP8 scaling keep no state.
FP8_DIRECTIONS = ("fwd", "bwd")
RECIPE_KEY = "recipe"


def _fp8_stateful_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """TE modules (anything with TE's ``fp8_meta`` and ``init_fp8_meta_tensors``), by clean name."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fp8_meta", None), dict) and hasattr(
            module, "init_fp8_meta_tensors"
        ):
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


@torch.no_grad()
def load_fp8_scaling_state(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], recipe: Any
) -> list[str]:
    """Put :func:`fp8_scaling_state` tensors back into the TE modules that run ``recipe`` (a
    delayed-scaling recipe); returns the names of the modules restored.

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
        meta = module.fp8_meta
        meta["recipe"] = recipe
        meta["num_gemms"] = tensors[f"{prefix}scale_fwd"].numel() // 3
        meta["fp8_checkpoint"] = True
        module.init_fp8_meta_tensors(recipe)
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
    before = {k: v.clone() for k, v in fp8_scaling_state(model).items() if not _is_recipe(k)}
    try:
        yield
    finally:
        with torch.no_grad():
            for key, live in fp8_scaling_state(model).items():
                if _is_recipe(key):
                    continue
                if key in before:
                    live.copy_(before[key])
                else:  # a module whose first FP8 forward was this one: back to TE's fresh state
                    live.fill_(1.0 if key.rsplit(".", 1)[-1].startswith("scale") else 0.0)


def _is_recipe(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == RECIPE_KEY


def head_dim_of(config: Any) -> int:
    """Per-head width: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# --------------------------------------------------------------------------------------------
# HF's RoPE settings and attention mask in the form TE's TransformerLayer takes.
# --------------------------------------------------------------------------------------------


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a Llama config as a plain dict with ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; older configs used ``rope_theta``
    and ``rope_scaling`` attributes. Both are read so a config from either era works.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in dict(legacy).items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def llama_rope_inv_freq(config: Any) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, ``[head_dim // 2]``) for ``default`` and ``llama3`` RoPE.

    Written from the Llama 3 reference (wavelength bands with linear smoothing) rather than
    borrowed from transformers, so tests can check it against HF independently. Other RoPE
    types are refused: TE receives these frequencies verbatim and a silent mismatch with the
    HF checkpoint's positional encoding would only show as worse loss.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    head_dim = head_dim_of(config)
    # Explicitly on CPU: models are built under ``torch.device("meta")``, and meta frequencies
    # would have no values to copy later.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponent)
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by the TE implementation "
            "(supported: default, llama3); use --model_impl hf"
        )
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    context = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """TE's ``rotary_pos_emb``: angles ``[seq, 1, 1, head_dim]`` in fp32, halves duplicated.

    TE (non-interleaved) rotates halves exactly like HF's ``rotate_half`` and takes cos/sin of
    these angles itself, so ``cat(freqs, freqs)`` here equals HF's ``emb`` before ``cos``.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def batch_positions(
    position_ids: torch.Tensor | None, seq_len: int, device: torch.device
) -> torch.Tensor:
    """One position vector for the batch: TE's fused RoPE takes ``[s, 1, 1, d]`` frequencies."""
    if position_ids is None:
        return torch.arange(seq_len, device=device)
    if position_ids.dim() == 1:
        return position_ids
    if position_ids.shape[0] > 1 and not bool((position_ids == position_ids[:1]).all()):
        raise ValueError(
            "TE decoder layers need the same position_ids for every sequence in the batch "
            "(packed training windows satisfy this); use --model_impl hf for per-row positions"
        )
    return position_ids[0]


def hf_mask_to_te(attention_mask: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
    """Map HF's 4-D mask to TE's ``(self_attn_mask_type, attention_mask)``.

    HF passes ``None`` for plain causal attention (SDPA, no padding): TE's built-in ``causal``
    is used. Otherwise the mask already combines causality and padding; TE takes it as an
    ``arbitrary`` boolean mask where True means *masked out* (HF's bool masks mean *attend*,
    its float masks are additive with large negatives at masked positions).
    """
    if attention_mask is None:
        return "causal", None
    if attention_mask.dim() != 4:
        raise ValueError(
            "TE decoder layers expect HF's 4-D attention mask, got shape "
            f"{tuple(attention_mask.shape)} (is config._attn_implementation flash-attention?)"
        )
    if attention_mask.dtype == torch.bool:
        return "arbitrary", ~attention_mask
    return "arbitrary", attention_mask < 0
