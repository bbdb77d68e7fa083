"""TEST DOUBLE of ``transformer_engine.pytorch.optimizers``: ``FusedAdam``'s constructor only.

TE's FusedAdam is GPU-only: its constructor validates the state dtypes and then allocates its
overflow buffer on ``"cuda"`` (transformer_engine/pytorch/optimizers/fused_adam.py), so on a
machine without CUDA it raises before it holds any state. That is all this double does: the
recipe builds FusedAdam only for a CUDA device (te_precision.TEBackend.master_weight_adam) and
never on the CPU machines the double serves, where
model_utils.precision.master_weights.MasterWeightAdamW runs instead. The signature is TE 2.20.2's,
checked by tests/integration/test_te_contract.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none: bool | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and master_weight_dtype not in [torch.float32, torch.float16]:
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.master_weights = master_weights
        # TE's next line: the multi-tensor kernels' overflow flag, on the GPU.
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cuda")
