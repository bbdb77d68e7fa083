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

from model_utils.parallel.distributed import canonical_param_name

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

    # TE FusedAdam's API for setting up state (its first step and seed_masters call it).

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """The state a first step creates: zero moments and the master from the parameter, in
        fp32 and sharded like the parameter (a DTensor for a DTensor), so DCP saves and
        reshards them as it does the parameter."""
        if store_param_remainders:
            raise ValueError("MasterWeightAdamW keeps whole fp32 masters, not bf16 remainders")
        state = self.state[param]
        state["exp_avg"] = torch.zeros_like(param, dtype=MASTER_DTYPE)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=MASTER_DTYPE)
        state["master_param"] = param.detach().to(MASTER_DTYPE, copy=True)

    @torch.no_grad()
    def set_scaled_state(
        self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor
    ) -> None:
        """Overwrite this rank's shard of one state (all are fp32 here: nothing to scale)."""
        _local(self.state[param][state_name]).copy_(unscaled_state)

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
            for param in group["params"]:
                if not self.state[param]:
                    self.initialize_state(param)
            live = [(p, self.state[p]) for p in group["params"] if p.grad is not None]
            if live:
                _adamw_update(group, live)
        return loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is one of Transformer Engine's quantized
    tensors (``--fp8_weights``). Read by its API, not its class, so TE need not be importable:
    a QuantizedTensor has ``quantize_`` (writes by quantizing) and ``dequantize(dtype=...)``."""
    return callable(getattr(_local(tensor), "quantize_", None))


def remember_full_precision(param: nn.Parameter, value: torch.Tensor) -> None:
    """Keep ``value`` (this rank's shard, as initialised or loaded) for ``seed_masters`` when the
    parameter stores it with less precision (bf16 or FP8). On the host, as TE's
    ``preserve_high_precision_init_val`` does: it is freed once the optimizer holds it.

    Not TE's own preserved value: ``modeling.init_weights`` writes the recipe's seeded init
    after TE's ``reset_parameters``, so TE's copy would hold TE's init, not the run's."""
    if is_quantized(param) or _local(param).dtype != MASTER_DTYPE:
        param._master_seed = value.detach().to("cpu", MASTER_DTYPE, copy=True)


def has_seed(param: torch.Tensor) -> bool:
    return hasattr(param, "_master_seed")


@torch.no_grad()
def seed_masters(optimizer: torch.optim.Optimizer) -> int:
    """Set up a master-weight optimizer's whole state now, as its first step would, but with
    each master at its parameter's full-precision value (``remember_full_precision``), then
    drop the host copies. Returns the number of masters seeded.

    Without the seeds a master starts as the stored parameter: bf16, or for FP8 parameters the
    FP8 value, so the run would train from a rounded init. The state must be whole, with each
    group's ``step``, because DCP loads a resume into the state that exists: torch builds it by
    a zero-lr step only when there is none. Call once, after the optimizer is built and before
    a checkpoint is resumed (a resume replaces all of it). Both optimizers take TE FusedAdam's
    calls, ``initialize_state`` and ``set_scaled_state``."""
    if not getattr(optimizer, "master_weights", False):
        return 0
    seeded = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.initialize_state(param, store_param_remainders=False)
            if has_seed(param):
                value = param._master_seed.to(_local(param).device)
                optimizer.set_scaled_state(param, "master_param", value)
                del param._master_seed
                seeded += 1
        group.setdefault("step", 0)  # both count steps per group; the first step makes it 1
    return seeded


@torch.no_grad()
def requantize_from_masters(optimizer: torch.optim.Optimizer) -> int:
    """Write every FP8 parameter from its fp32 master again, as the optimizer's step does.

    A checkpoint holds FP8 parameters as plain high-precision values (``checkpoint.ModelItem``)
    so it loads with ``--fp8_weights`` on or off, at any world size; quantising those values
    would not give back the FP8 bytes the step wrote from the master. Quantising the restored
    master with the restored scaling state does, so a resumed run continues exactly. Call after
    the model, the FP8 scaling state and the optimizer are loaded. Returns the count written."""
    written = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            master = optimizer.state.get(param, {}).get("master_param")
            if master is None or not is_quantized(param):
                continue
            _local(param).quantize_(_local(master))
            written += 1
    return written


def masters_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master (as the parameter is sharded), under the parameter's clean
    name; empty for an optimizer without masters. What an HF export writes in a master-weights
    run: the parameters are these rounded to bf16 or FP8."""
    named = {}
    for name, param in model.named_parameters():
        master = optimizer.state.get(param, {}).get("master_param")
        if master is not None:
            named[canonical_param_name(name)] = master
    return named


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
    exp_avgs, exp_avg_sqs, masters = ([s[name] for _, s in live] for name in STATE_NAMES)
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
