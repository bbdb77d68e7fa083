"""Transformer Engine glue the library needs without the model file: the fused layout's name,
TE's extra-state keys, parameter materialisation, RoPE and masks in TE's form.

``te_llama.py`` (repo root) is the model: it builds the TE decoder and owns the HF <-> TE
weight table. What ``model_utils`` itself must do with the TE model lives here, so no package
module imports upward from the root: recognise the fused layout and TE's extra state in a state
dict, materialise TE parameters after ``to_empty``, and give TE HF's RoPE and attention mask.
Importing TE is ``config/te_loader.py``'s (one importer, one error); the micro-batch flag and
the FP8 scaling state are the precision stage's (``precision/te_state.py``).

Importing this module never imports TE; the TE modules it handles are recognised by their
attributes (``param_init_meta``), not their classes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from model_utils.config.families import head_dim_of
from model_utils.config.hf_config import rope_parameters


def is_te_extra_state_key(key: str) -> bool:
    """TE modules add ``<module>._extra_state`` (FP8 scaling metadata) to their state dict.

    It is bookkeeping, not a weight: weights converted from HF have none (TE starts fresh FP8
    statistics, as after a change of recipe), and checkpoints store it as plain tensors instead.
    """
    return key.endswith("._extra_state") or key == "_extra_state"


# ---- Initialisation hook


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


# ---- HF's RoPE settings and attention mask in the form TE's TransformerLayer takes


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
