"""A pure-PyTorch reference of what ``te.pytorch.TransformerLayer`` computes for our settings.

Settings: pre-norm RMSNorm, fused QKV weight ``[q; k; v]`` (``qkv_weight_interleaved=False``),
GQA with query head ``h`` reading KV group ``h // (heads / groups)`` (TE's
``repeat_interleave``), non-interleaved RoPE (rotate-half) from fp32 angles
``[s, 1, 1, d]``, softmax scale ``1/sqrt(head_dim)``, SwiGLU with the gate in the first half of
``fc1``, no biases, residual adds. Written from TE's documented semantics, not from HF's code,
so the layout test compares two independent implementations.

``linear`` is injectable so the TE test double can run the same math with emulated FP8 GEMMs,
and ``attention_cast`` so it can round attention's operands through FP8 (``fp8_dpa``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
#: ``cast(tensor, role)`` for attention's operands: role ``qkv`` (each of Q, K, V after RoPE),
#: ``s`` (the softmax probabilities) or ``o`` (the output); identity unless FP8 attention.
Cast = Callable[[torch.Tensor, str], torch.Tensor]


def no_cast(x: torch.Tensor, role: str) -> torch.Tensor:
    return x


def plain_linear(x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """``x @ weight.T``; ``name`` identifies the GEMM for FP8-emulating substitutes."""
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``, statistics in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``t`` of shape ``[b, s, h, d]`` by angles ``freqs`` of shape ``[s2>=s, 1, 1, d]``."""
    seq = t.shape[1]
    angles = freqs[:seq].transpose(0, 1).float()  # [1, s, 1, d]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    first, second = t.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return t * cos + rotated * sin


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask_type: str,
    mask: torch.Tensor | None,
    dropout: float = 0.0,
    training: bool = False,
    cast: Cast = no_cast,
) -> torch.Tensor:
    """Scaled dot-product attention on ``[b, s, heads, d]``; ``mask`` True = masked out."""
    q, k, v = cast(q, "qkv"), cast(k, "qkv"), cast(v, "qkv")
    heads, groups = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    blocked = torch.zeros(scores.shape[-2:], dtype=torch.bool, device=scores.device)
    if mask_type in ("causal", "padding_causal"):
        blocked = torch.ones_like(blocked).triu(1)
    elif mask_type not in ("no_mask", "arbitrary", "padding"):
        raise NotImplementedError(f"reference has no mask type {mask_type!r}")
    if mask is not None and mask_type != "causal":
        blocked = blocked | mask
    # A finite fill (not -inf) keeps fully masked rows (padding) finite, as fused kernels do.
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    probs = F.dropout(scores.softmax(-1), p=dropout, training=training).to(v.dtype)
    return cast((cast(probs, "s") @ v).transpose(1, 2), "o")  # [b, s, h, d]


def transformer_layer(
    hidden_states: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    *,
    eps: float,
    linear: Linear = plain_linear,
    hidden_dropout: float = 0.0,
    training: bool = False,
    **attention: Any,
) -> torch.Tensor:
    """One decoder layer on ``[b, s, hidden]`` with weights named as in ``TransformerLayer``:

    ``self_attention.layernorm_qkv.{layer_norm_weight,weight}``, ``self_attention.proj.weight``,
    ``layernorm_mlp.{layer_norm_weight,fc1_weight,fc2_weight}``. ``attention``: the rest of
    :func:`attention_block`'s keywords.
    """
    common = dict(eps=eps, linear=linear, hidden_dropout=hidden_dropout, training=training)
    return mlp_block(
        attention_block(hidden_states, weights, **common, **attention), weights, **common
    )


def attention_block(
    hidden_states: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    *,
    num_heads: int,
    num_groups: int,
    head_dim: int,
    eps: float,
    rotary_pos_emb: torch.Tensor | None,
    mask_type: str = "causal",
    attention_mask: torch.Tensor | None = None,
    linear: Linear = plain_linear,
    attention_dropout: float = 0.0,
    hidden_dropout: float = 0.0,
    training: bool = False,
    attention_cast: Cast = no_cast,
) -> torch.Tensor:
    """The layer's first half: ``hidden + proj(attention(qkv(rms_norm(hidden))))``."""
    batch, seq, _ = hidden_states.shape
    x = rms_norm(hidden_states, weights["self_attention.layernorm_qkv.layer_norm_weight"], eps)
    qkv = linear(x, weights["self_attention.layernorm_qkv.weight"], "qkv")
    q_rows, kv_rows = num_heads * head_dim, num_groups * head_dim
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=-1)
    q = q.reshape(batch, seq, num_heads, head_dim)
    k = k.reshape(batch, seq, num_groups, head_dim)
    v = v.reshape(batch, seq, num_groups, head_dim)
    if rotary_pos_emb is not None:
        q, k = apply_rope(q, rotary_pos_emb), apply_rope(k, rotary_pos_emb)
    context = attention(
        q,
        k,
        v,
        mask_type=mask_type,
        mask=attention_mask,
        dropout=attention_dropout,
        training=training,
        cast=attention_cast,
    )
    attn_out = linear(
        context.reshape(batch, seq, q_rows), weights["self_attention.proj.weight"], "proj"
    )
    return hidden_states + F.dropout(attn_out, p=hidden_dropout, training=training)


def mlp_block(
    hidden: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    *,
    eps: float,
    linear: Linear,
    hidden_dropout: float,
    training: bool,
) -> torch.Tensor:
    """The layer's second half: ``hidden + dropout(mlp(hidden))``."""
    out = mlp(hidden, weights, eps=eps, linear=linear)
    return hidden + F.dropout(out, p=hidden_dropout, training=training)


def mlp(
    hidden: torch.Tensor, weights: Mapping[str, torch.Tensor], *, eps: float, linear: Linear
) -> torch.Tensor:
    """TE's ``layernorm_mlp`` (no residual): ``fc2(swiglu(fc1(rms_norm(hidden))))``."""
    y = rms_norm(hidden, weights["layernorm_mlp.layer_norm_weight"], eps)
    gate, up = linear(y, weights["layernorm_mlp.fc1_weight"], "fc1").chunk(2, dim=-1)
    return linear(F.silu(gate) * up, weights["layernorm_mlp.fc2_weight"], "fc2")
