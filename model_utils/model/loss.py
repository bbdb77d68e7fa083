"""The causal-LM loss without the full logits: ``lm_head`` and cross-entropy, chunk by chunk.

Hugging Face's loss materialises ``[tokens, vocab]`` logits in bf16, upcasts them to fp32 and
keeps both plus their gradient: for Llama 3 at seq 8192 and micro-batch 4 that is 15.7 GiB for
the fp32 copy alone, which caps the micro-batch (docs/performance.md). Here the logits exist for
one chunk of tokens at a time: the forward computes each chunk's loss *and* its gradients with
respect to the hidden states and ``lm_head``'s weight (the softmax minus the one-hot target, as
autograd would), so nothing is recomputed in backward and the extra memory is one chunk's
logits plus one weight-sized gradient, whatever the vocabulary and batch.

Numerics follow transformers' ``ForCausalLMLoss``: labels shifted left by one, ``-100``
ignored, logits upcast to fp32 before the log-softmax, mean over the counted tokens; the
gradient reaching the bf16 matmuls is cast to bf16 as autograd's would be (before the ``1 / N``
scale, which is applied on the small side). Results equal the plain path up to summation order
and that one rounding (tests/unit/test_loss.py).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_utils.model.annotate import LM_HEAD, annotate
from model_utils.precision.output_gemms import Fp8Gemms, Gemms

IGNORE_INDEX = -100
#: ``(logits, targets) -> (per-token losses, unscaled d loss / d logits)`` for one chunk.
ChunkFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: Logit elements per chunk (256 MiB in fp32) on a small model: 1,024 tokens at a 64k vocabulary.
CHUNK_LOGITS = 2**26
#: ... but never fewer tokens than this many times the hidden width: every chunk pays one pass
#: over the fp32 ``lm_head`` gradient (vocab x hidden), its useful work is tokens x vocab.
MIN_CHUNK_TOKENS_PER_HIDDEN = 2


def chunk_tokens(vocab: int, hidden: int) -> int:
    """Tokens per chunk: small enough that the logits stay a fraction of HF's, large enough that
    the per-chunk gradient accumulation stays a few percent of the step.

    Small chunks spend the step on the per-chunk gradient accumulation, so a chunk holds at least
    2x hidden tokens (the H100 measurements that set this: docs/performance.md, "The chunked
    loss"). On the tiny CPU model (hidden 256) the 1,024-token floor wins.
    """
    return max(1, CHUNK_LOGITS // vocab, MIN_CHUNK_TOKENS_PER_HIDDEN * hidden)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing (ignored)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _chunk_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities of one chunk's logits, as HF's loss computes them (upcast, then
    log-softmax), with at most two fp32 chunks alive: the logits are freed at the upcast by
    the caller. One fused log-softmax replaces ``logsumexp`` + subtract: torch's ``logsumexp``
    is composite (max, a full-size ``x - max`` temporary, exp, sum), four passes and one more
    chunk of memory."""
    return torch.log_softmax(logits.float(), dim=-1)


def _chunk_losses(log_probs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token ``-log p(target)`` (0 where ignored), the target log-probabilities and the mask."""
    valid = targets != IGNORE_INDEX
    picked = log_probs.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    return -(picked * valid), picked, valid


def softmax_minus_target(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's per-token losses (fp32, 0 where ignored) and ``d loss / d logits`` unscaled:
    ``softmax - one_hot(target)`` rounded to the logits' dtype once, as autograd's cast would.

    Eager, the ``[tokens, vocab]`` work is three passes: the upcast, the log-softmax, and one
    ``exp`` that writes the softmax straight into bf16 (the target entries are fixed after).
    """
    dtype = logits.dtype
    log_probs = _chunk_log_probs(logits)
    del logits
    losses, picked, valid = _chunk_losses(log_probs, targets)
    d = torch.exp(log_probs, out=torch.empty_like(log_probs, dtype=dtype))
    del log_probs
    rows = torch.arange(d.shape[0], device=d.device)
    d[rows, torch.where(valid, targets, 0)] = picked.exp().sub_(1.0).to(d.dtype)
    return losses, d


def _softmax_minus_target_fusable(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_minus_target` written for ``torch.compile``: no in-place writes or
    ``out=``, the one-hot as a comparison, so inductor fuses everything after the GEMM into
    one reduction and one pointwise kernel over the bf16 logits (no fp32 chunk is stored)."""
    x = logits.float()
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)[:, None]
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    losses = (log_z - x.gather(1, safe)).squeeze(1) * valid
    probs = torch.exp(x - log_z)
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == safe
    return losses, torch.where(hit, probs - 1.0, probs).to(logits.dtype)


@functools.cache
def compiled_softmax_minus_target() -> ChunkFn:
    """The fused chunk (``--compile``), compiled once per process on first use. Static shapes:
    the chunks of a run share one shape, a ragged last chunk adds one more graph."""
    return torch.compile(_softmax_minus_target_fusable, dynamic=False, fullgraph=True)


class _LinearCrossEntropy(torch.autograd.Function):
    """``mean CE(hidden @ weight.T, targets)`` with gradients computed chunk by chunk.

    Per chunk: the logits GEMM, ``chunk_fn`` (the softmax gradient: :func:`softmax_minus_target`
    or its compiled twin) and the two GEMMs that read its bf16 gradient (``gemms_of``:
    :class:`Gemms` or :class:`Fp8Gemms`). The ``1 / counted`` scale and the ignored rows are
    applied to the small side (``hidden`` rows, the chunk's ``grad_hidden``, the weight gradient
    once at the end), never to the logits: at Llama 3's vocabulary each full-size pass is GiBs
    of memory traffic.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, chunk_fn: ChunkFn, gemms_of: type):
        counted = (targets != IGNORE_INDEX).sum().clamp_min(1)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        gemms = gemms_of(weight)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], targets[start : start + chunk]
            losses, d = chunk_fn(gemms.logits(h), y)
            total += losses.sum()
            valid = y != IGNORE_INDEX
            g = gemms.grad_hidden(d, out=grad_hidden[start : start + chunk])
            g.mul_((valid / counted)[:, None])  # an fp32 factor: one rounding, to bf16
            part = gemms.grad_weight(d, h * valid[:, None])  # ignored rows contribute nothing
            grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        ctx.save_for_backward(grad_hidden, grad_weight, counted)
        ctx.weight_dtype = weight.dtype
        return total / counted

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, counted = ctx.saved_tensors
        # The weight gradient's 1 / counted scale and its cast to the weight's dtype: one pass.
        weight = torch.empty_like(grad_weight, dtype=ctx.weight_dtype)
        torch.mul(grad_weight, grad_output / counted, out=weight)
        hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        return hidden, weight, None, None, None, None  # none for targets, chunk and the functions


def _loss_only(hidden: torch.Tensor, targets: torch.Tensor, chunk: int, gemms: Gemms):
    """The same loss without gradients (evaluation under ``torch.no_grad``): no GEMMs for them."""
    counted = (targets != IGNORE_INDEX).sum().clamp_min(1)
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        log_probs = _chunk_log_probs(gemms.logits(hidden[start : start + chunk]))
        total += _chunk_losses(log_probs, targets[start : start + chunk])[0].sum()
    return total / counted


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | None = None,
    compiled: bool = False,
    fp8: bool = False,
) -> torch.Tensor:
    """Causal-LM loss of ``hidden`` ``[batch, seq, h]`` through ``lm_head`` weight ``[V, h]``
    against unshifted ``labels`` ``[batch, seq]`` (what HF models take); ``compiled`` runs each
    training chunk through :func:`compiled_softmax_minus_target`, ``fp8`` its GEMMs through
    :class:`Fp8Gemms`. Under torch.autocast (no FSDP2 to cast ``weight``) the GEMMs read both
    operands in autocast's dtype, outside autocast: the loss's own casts are exact."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # no FSDP2: run the GEMMs as autocast would
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(
                hidden.to(dtype), weight.to(dtype), labels, chunk, compiled, fp8
            )
    chunk = chunk or chunk_tokens(weight.shape[0], weight.shape[1])
    targets = shift_labels(labels).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    gemms_of = Fp8Gemms if fp8 else Gemms
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _loss_only(flat, targets, chunk, gemms_of(weight))
    chunk_fn = compiled_softmax_minus_target() if compiled else softmax_minus_target
    return _LinearCrossEntropy.apply(flat, weight, targets, chunk, chunk_fn, gemms_of)


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
    with annotate(LM_HEAD):
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        return linear_cross_entropy(
            hidden, self.weight, labels, compiled=self.compiled_loss, fp8=self.fp8_loss
        )


def use_chunked_loss(model: nn.Module, compiled: bool = False, fp8: bool = False) -> nn.Module:
    """Make ``model(input_ids, labels=...)`` compute the loss chunk by chunk (no full logits);
    ``compiled`` (``--compile``) fuses each chunk's softmax gradient with torch.compile; ``fp8``
    (``--fp8_lm_head``) runs the loss's GEMMs in FP8.

    Set on the instances, so parameter names, checkpoints and HF export stay exactly as they are.
    """
    if model.lm_head.bias is not None:
        raise ValueError("the chunked loss expects lm_head without a bias (Llama has none)")
    model.lm_head.compiled_loss = compiled
    model.lm_head.fp8_loss = fp8
    model.lm_head.forward = types.MethodType(_lm_head_forward, model.lm_head)
    model.forward = types.MethodType(_forward_with_chunked_loss, model)
    return model


def annotate_lm_head(model: nn.Module) -> nn.Module:
    """``--chunked_loss=0``: ``lm_head``'s GEMM (not HF's loss after it) inside the ``lm_head``
    range, so a profile counts it among the matmuls FP8 does not run (set on the instance; HF's
    forward gives it no labels)."""
    model.lm_head.forward = types.MethodType(_lm_head_forward, model.lm_head)
    return model
