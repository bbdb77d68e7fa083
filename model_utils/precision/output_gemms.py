"""The output layer's three GEMMs, as the chunked loss (model/loss.py) runs them: in the
compute dtype, or in FP8 (--fp8_lm_head) by per-tensor current scaling, emulated on a CPU."""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def cool_lm_head(model: torch.nn.Module) -> None:
    """The chunked loss's GEMMs (--fp8_lm_head) back in the compute dtype: --bf16_cooldown."""
    head = getattr(model, "lm_head", None)
    if getattr(head, "fp8_loss", False):
        head.fp8_loss = False


def _to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with its own scale (current scaling: the format's largest value
    over the amax), and the inverse scale that undoes it. As in TE's current scaling, a scale
    past fp32's range stops at its largest and an all-zero ``x`` (a chunk whose every target
    is ignored) gets 1: 0 x inf would be NaN."""
    largest, amax = torch.finfo(dtype).max, x.detach().abs().max().float()
    scale = (largest / amax).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return (x.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


def scaled_mm(qa, qb_t, inv_a, inv_b, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``qa @ qb_t.T`` times both inverse scales, by torch's FP8 GEMM (``qa`` row-major,
    the second operand column-major: ``qb_t`` row-major, transposed)."""
    return torch._scaled_mm(
        qa.contiguous(), qb_t.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=dtype
    )


def fp8_product(qa, inv_a, qb_t, inv_b, dtype: torch.dtype) -> torch.Tensor:
    """``qa @ qb_t.T`` undone by both inverse scales, in ``dtype``. On CUDA with 16-aligned
    shapes FP8 tensor cores run it (:func:`scaled_mm`); elsewhere it is emulated: the casts'
    rounding already happened, the product runs in fp32."""
    if qa.is_cuda and not (qa.shape[0] % 16 or qa.shape[1] % 16 or qb_t.shape[0] % 16):
        return scaled_mm(qa, qb_t, inv_a, inv_b, dtype)
    return ((qa.float() * inv_a) @ (qb_t.float() * inv_b).t()).to(dtype)


def fp8_mm(a: torch.Tensor, b: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """``a @ b`` with both operands cast to FP8 per tensor: e4m3, or e5m2 for a gradient ``a``
    (``grad``), as TE's hybrid format."""
    qa, inv_a = _to_fp8(a, E5M2 if grad else E4M3)
    qb_t, inv_b = _to_fp8(b.t().contiguous(), E4M3)
    return fp8_product(qa, inv_a, qb_t, inv_b, a.dtype)


class Gemms:
    """The loss's three GEMMs with ``lm_head``'s weight ``[V, h]``, in the compute dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.t()

    def grad_hidden(self, d: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.mm(d, self.weight, out=out)

    def grad_weight(self, d: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return d.t() @ hidden


class Fp8Gemms(Gemms):
    """The same GEMMs in FP8 (--fp8_lm_head): per-tensor current scaling, e4m3 for the hidden
    states and the weight, e5m2 for the gradient ``d``. The weight is cast once per loss call,
    not once per chunk and GEMM: one amax pass and one scale for the whole vocabulary (the
    result is the same, the weight does not change within a step), kept in the two layouts
    the GEMMs read. The weight itself is not touched: a tied embedding reads it unchanged."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.q_weight, self.inv_weight = _to_fp8(weight, E4M3)  # [V, h]: the logits' operand
        self._q_weight_t: torch.Tensor | None = None  # [h, V]: the hidden gradient's

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        q, inv = _to_fp8(hidden, E4M3)
        return fp8_product(q, inv, self.q_weight, self.inv_weight, hidden.dtype)

    def grad_hidden(self, d: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self._q_weight_t is None:
            self._q_weight_t = self.q_weight.t().contiguous()
        q, inv = _to_fp8(d, E5M2)
        return out.copy_(fp8_product(q, inv, self._q_weight_t, self.inv_weight, d.dtype))

    def grad_weight(self, d: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return fp8_mm(d.t(), hidden, grad=True)
