"""The causal-LM loss without the full logits: ``lm_head`` and cross-entropy, chunk by chunk.

Hugging Face's loss materialises ``[tokens, vocab]`` logits in bf16, upcasts them to fp32 and
keeps both plus their gradient: for Llama 3 at seq 8192 and micro-batch 4 that is 15.7 GiB for
the fp32 copy alone, which is what capped the micro-batch on an H100. Here the logits exist for
one chunk of tokens at a time: the forward computes each chunk's loss *and* its gradients with
respect to the hidden states and ``lm_head``'s weight (the softmax minus the one-hot target, as
autograd would), so nothing is recomputed in backward and the extra memory is one chunk's
logits plus one weight-sized gradient, whatever the vocabulary and batch.

Numerics follow transformers' ``ForCausalLMLoss``: labels shifted left by one, ``-100``
ignored, logits upcast to fp32 before the log-softmax, mean over the counted tokens; the
gradient reaching the bf16 matmuls is cast to bf16 as autograd's would be. Results equal the
plain path up to floating-point summation order (tests/unit/test_loss.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
#: Logit elements per chunk (256 MiB in fp32) on a small model: 1,024 tokens at a 64k vocabulary.
CHUNK_LOGITS = 2**26
#: ... but never fewer tokens than this many times the hidden width: every chunk pays one pass
#: over the fp32 ``lm_head`` gradient (vocab x hidden), its useful work is tokens x vocab.
MIN_CHUNK_TOKENS_PER_HIDDEN = 2


def chunk_tokens(vocab: int, hidden: int) -> int:
    """Tokens per chunk: small enough that the logits stay a fraction of HF's, large enough that
    the per-chunk gradient accumulation stays a few percent of the step.

    Measured on an H100 (Llama 3, hidden 4096, vocab 128256, 16k tokens per micro-batch, te-fp8):
    512-token chunks (32 per step) ran at 0.66x of HF's loss, nearly all of it the per-chunk
    gradient accumulation; 8,192-token chunks (2 per step, 4 GiB of fp32 logits each) run at
    0.95x and free 10 GiB, enough for micro-batch 4. On the tiny CPU model (hidden 256) the
    1,024-token floor from CHUNK_LOGITS wins.
    """
    return max(1, CHUNK_LOGITS // vocab, MIN_CHUNK_TOKENS_PER_HIDDEN * hidden)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing (ignored)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class _LinearCrossEntropy(torch.autograd.Function):
    """``mean CE(hidden @ weight.T, targets)`` with gradients computed chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        counted = (targets != IGNORE_INDEX).sum().clamp_min(1)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], targets[start : start + chunk]
            logits = (h @ weight.t()).float()
            valid = y != IGNORE_INDEX
            safe = torch.where(valid, y, 0)
            log_z = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += ((log_z - picked) * valid).sum()
            if grads:
                d = logits.sub_(log_z[:, None]).exp_()  # softmax, in place of the logits
                d[torch.arange(d.shape[0], device=d.device), safe] -= 1.0
                # Scale and cast in one pass (the fp32 chunk is GiBs at Llama 3's vocabulary).
                d = torch.mul(
                    d, (valid / counted)[:, None], out=torch.empty_like(d, dtype=hidden.dtype)
                )
                grad_hidden[start : start + chunk] = d @ weight
                grad_weight.add_(d.t() @ h)  # one mixed-dtype kernel into the fp32 sum
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / counted

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype),
            (grad_weight * grad_output).to(ctx.weight_dtype),
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Causal-LM loss of ``hidden`` ``[batch, seq, h]`` through ``lm_head`` weight ``[V, h]``
    against unshifted ``labels`` ``[batch, seq]`` (what HF models take)."""
    chunk = chunk or chunk_tokens(weight.shape[0], weight.shape[1])
    targets = shift_labels(labels).reshape(-1)
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets, chunk)


def _forward_with_chunked_loss(
    self: nn.Module, input_ids=None, labels=None, attention_mask=None, **kwargs: Any
):
    """``LlamaForCausalLM.forward`` that returns the loss without logits when given labels."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = hidden.last_hidden_state
    if labels is None:
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))
    return CausalLMOutputWithPast(loss=self.lm_head(hidden, labels=labels))


def _lm_head_forward(self: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None):
    """Logits without labels (generation, export), the chunked loss with them.

    The loss runs *inside* ``lm_head``'s forward so that module hooks fire as for any layer:
    FSDP2 gathers ``lm_head`` (its own unit with the final norm, as torchtitan shards it) in its
    pre-forward and schedules its gradient reduce-scatter from there.
    """
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    return linear_cross_entropy(hidden, self.weight, labels)


def use_chunked_loss(model: nn.Module) -> nn.Module:
    """Make ``model(input_ids, labels=...)`` compute the loss chunk by chunk (no full logits).

    Set on the instances, so parameter names, checkpoints and HF export stay exactly as they are.
    """
    if model.lm_head.bias is not None:
        raise ValueError("the chunked loss expects lm_head without a bias (Llama has none)")
    model.lm_head.forward = types.MethodType(_lm_head_forward, model.lm_head)
    model.forward = types.MethodType(_forward_with_chunked_loss, model)
    return model
