"""TEST DOUBLE of ``transformer_engine.pytorch.quantized_tensor.QuantizedTensor`` (TE 2.20.2),
the parameter type TE builds under ``quantized_model_init`` (``--fp8_weights``).

What the recipe relies on, and so what this models (tests/integration/test_te_contract.py
reads each rule in TE's source):

* it is a ``torch.Tensor`` whose ``dtype`` is the nominal high-precision dtype, while it holds
  FP8 bytes and a scale;
* ``dequantize(*, dtype=None)`` gives the value as a plain tensor;
* ``quantize_(tensor)`` writes ``tensor`` into it by quantising (the FP8 bytes change);
* ``copy_`` into it quantises (TE's ``__torch_dispatch__``: ``dst.quantize_(src)``); ``copy_``
  from it into a plain tensor dequantises; ``detach`` keeps the subclass and its bytes;
* any other op sees the dequantised value.

The scaling is TE's per-tensor current scaling in E4M3 (Float8CurrentScalingQuantizer).
The double's TE modules do not build these (their ``quantized_model_init`` rounds values only,
because FSDP2 would need TE's ``fsdp_pre_all_gather`` hooks too); unit tests build them with
``quantize`` to check the recipe's code against this API.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

FP8_DTYPE = torch.float8_e4m3fn


class QuantizedTensor(torch.Tensor):
    _data: torch.Tensor
    _scale_inv: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        instance = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )
        instance._data = data
        instance._scale_inv = scale_inv
        return instance

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, values: torch.Tensor, dtype: torch.dtype | None = None) -> QuantizedTensor:
        """``values`` in FP8 with a per-tensor scale from their amax (TE's current scaling)."""
        data, scale_inv = _quantize(values)
        return cls(data, scale_inv, dtype or values.dtype)

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self._data.float() * self._scale_inv).to(dtype or self.dtype)

    def quantize_(self, tensor: torch.Tensor) -> QuantizedTensor:
        data, scale_inv = _quantize(tensor)
        self._data.copy_(data)
        self._scale_inv.copy_(scale_inv)
        return self

    def detach(self) -> QuantizedTensor:
        return QuantizedTensor(self._data, self._scale_inv, self.dtype)

    def __repr__(self) -> str:  # the default repr would read the wrapper's absent storage
        return f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func == torch.ops.aten.detach.default:
            return args[0].detach()
        if func == torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, QuantizedTensor):
                dst.quantize_(src.dequantize() if isinstance(src, QuantizedTensor) else src)
            else:
                dst.copy_(src.dequantize(dtype=dst.dtype))
            return dst

        def plain(value: Any) -> Any:
            return value.dequantize() if isinstance(value, QuantizedTensor) else value

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_max = torch.finfo(FP8_DTYPE).max
    amax = values.detach().abs().amax().float()
    scale = torch.where(amax > 0, fp8_max / amax.clamp_min(1e-30), torch.ones_like(amax))
    data = (values.detach().float() * scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
    return data, scale.reciprocal()
