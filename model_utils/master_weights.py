"""AdamW whose fp32 master weights live in the optimizer, for parameters stored in bf16.

By default (``--master_weights params``) the parameters themselves are the fp32 master weights:
FSDP2 casts each gathered unit to bf16 for compute, every step, and AdamW updates the fp32
shards. With ``--master_weights optimizer`` the model's parameters are stored in bf16 and the
optimizer keeps an fp32 copy of each (Megatron's and TE's way): FSDP2 gathers bf16 with no cast,
gradients arrive in bf16, and the update runs in fp32 on the master copy, which is then rounded
into the parameter. Without the fp32 copy an update smaller than half a bf16 step (2^-8 of the
weight) would be lost every time.

On CUDA with Transformer Engine the TE backend uses TE's fused kernel
(``te.optimizers.FusedAdam(master_weights=True)``); everywhere else (CPU, torchao, hf) this
class runs the same algorithm with torch's foreach ops. Both keep the state TE keeps, under TE's
names, so a checkpoint of either resumes with the other and converts across layouts like AdamW's
moments: ``exp_avg``, ``exp_avg_sq`` and ``master_param`` per parameter, and one ``step`` per
parameter group (TE's FusedAdam counts steps per group). The arithmetic is torch's foreach
AdamW (decoupled weight decay, bias-corrected moments, eps outside the square root), so on fp32
parameters this optimizer *is* torch's AdamW (tests/unit/test_master_weights.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: The per-parameter state of TE's FusedAdam with master weights (its ``name_to_dtype_map``),
#: which this optimizer keeps too (tests/integration/test_te_contract.py reads TE's names).
STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
MASTER_DTYPE = torch.float32


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of (bf16) parameters; see the module docstring."""

    #: As TE's FusedAdam(master_weights=True) says it (optim.describe reads it).
    master_weights = True

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero moments and the master copy, in fp32 and sharded like the parameter (a DTensor
        for a DTensor), so DCP saves and reshards them as it does the parameter."""
        state = self.state[param]
        state["exp_avg"] = torch.zeros_like(param, dtype=MASTER_DTYPE)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=MASTER_DTYPE)
        state["master_param"] = param.detach().to(MASTER_DTYPE, copy=True)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts every saved state tensor to its parameter's dtype, which would
        round the fp32 masters and moments to bf16 on each resume; set them again from the
        saved fp32 tensors (TE's FusedAdam overrides its load for the same reason)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            for name, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[param][name] = _fp32_copy(value, param)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # One count per group, advanced even for a group without gradients, as TE's
            # FusedAdam does: its checkpoints and ours hold the same ``step``.
            group["step"] = group.get("step", 0) + 1
            states = [self.state[p] or self._init_state(p) for p in group["params"]]
            live = [
                (p, s) for p, s in zip(group["params"], states, strict=True) if p.grad is not None
            ]
            if live:
                _adamw_update(group, live)
        return loss


def _fp32_copy(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A private fp32 copy of a loaded state tensor, on the parameter's device (a DTensor from
    DCP is already placed like its parameter)."""
    copied = value.detach().clone().to(MASTER_DTYPE)
    return copied if isinstance(copied, DTensor) else copied.to(param.device)


def _adamw_update(group: dict[str, Any], live: list[tuple[torch.Tensor, dict]]) -> None:
    """torch's foreach AdamW (torch/optim/adam.py ``_multi_tensor_adam``, decoupled weight
    decay), in its order of operations, on the fp32 masters; then each parameter takes its
    master's value (rounded to the parameter's dtype)."""
    params = [p for p, _ in live]
    masters = [s["master_param"] for _, s in live]
    exp_avgs = [s["exp_avg"] for _, s in live]
    exp_avg_sqs = [s["exp_avg_sq"] for _, s in live]
    grads = [p.grad.to(MASTER_DTYPE) for p in params]  # no copy when already fp32
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = group["step"]

    if weight_decay != 0:
        torch._foreach_mul_(masters, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    step_size = (lr / (1 - beta1**step)) * -1
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(masters, exp_avgs, denom, step_size)
    for param, master in zip(params, masters, strict=True):
        param.copy_(master)


def store_parameters_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Re-create every floating-point parameter of ``model`` in ``dtype`` (on the meta device,
    before sharding: FSDP2 takes each parameter's dtype as it finds it). Buffers keep theirs:
    RoPE's inverse frequencies stay fp32. A parameter shared by two modules (tied embeddings)
    stays one parameter."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(
                    param.detach().to(dtype), requires_grad=param.requires_grad
                )
            setattr(module, name, made[id(param)])
