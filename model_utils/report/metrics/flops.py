"""FLOPs per token: the model's cost that TFLOP/s and MFU divide by (model FLOPs, not hardware
FLOPs: see the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.config.families import FAMILIES

if TYPE_CHECKING:
    from model_utils.config.sections import ModelShape


def matmul_params(shape: ModelShape) -> int:
    """Weights that take part in a matrix multiply for every token (a Llama-shaped decoder).

    Per decoder layer: q ``h*(n_heads*d)``, k and v ``h*(n_kv*d)`` each, o ``(n_heads*d)*h``,
    gate/up/down ``3*h*intermediate``; plus ``lm_head`` ``h*vocab``. The input embedding is a
    table lookup, not a matmul, so it is excluded; norms (vectors) are excluded. ``lm_head`` is
    counted whether or not it is tied to the embedding: the matmul runs either way.
    """
    hidden, num_heads, num_kv_heads = shape.hidden_width, shape.num_heads, shape.num_key_value_heads
    if num_heads <= 0 or hidden % num_heads:
        raise ValueError(
            f"hidden ({hidden}) must be a positive multiple of num_heads ({num_heads})"
        )
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = hidden // num_heads
    attention = hidden * num_heads * head_dim * 2 + hidden * num_kv_heads * head_dim * 2
    mlp = 3 * hidden * shape.intermediate_size
    return shape.num_layers * (attention + mlp) + hidden * shape.vocab_size


def dense_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token of a dense decoder (Llama; Mistral without a window)
    = ``6 * N + 12 * L * n_heads * head_dim * seq_len``.

    - ``6 * N``: a matmul with N weights costs ``2N`` FLOPs per token forward and ``4N`` backward
      (grad of input and grad of weight). N is :func:`matmul_params`: every projection, the MLP
      and ``lm_head``; not the input embedding.
    - ``12 * L * n_heads * head_dim * seq_len``: per layer and token, ``Q @ K^T`` and
      ``softmax @ V`` cost ``2 * seq_len * head_dim`` each per query head forward, times 3 for
      forward + backward. Query heads, not KV heads: GQA shares K/V but computes every score.
      The causal mask is NOT discounted (the full ``seq x seq`` product is counted, as in
      torchtitan/PaLM), so a causal flash kernel does about half this attention work.
    - Not counted: norms, RoPE, SiLU, softmax, the loss, optimizer, and activation recompute.
    Tied embeddings would not change the result: the ``lm_head`` matmul costs the same whether
    its weight is shared (the tied case is counted in tests/unit/test_metrics.py).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    n = matmul_params(shape)
    return float(6 * n + 12 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len)


#: The FLOPs formulas, by the key a family's row names (config/families.ModelFamily.flops).
FORMULAS = {"dense": dense_flops_per_token}


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    return FORMULAS[FAMILIES[shape.model_family].flops](shape, seq_len)
