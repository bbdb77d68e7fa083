"""Parameter groups, AdamW (fp32 or torchao's 8-bit / FP8 states) and the learning-rate schedule.

Step numbering used throughout (and by the log line): optimizer steps are counted from 1.
``Batch N`` in the log is the N-th optimizer step and the lr printed with it is the lr that step
used, i.e. ``lr_at(N, ...)``. ``lr_at(0, ...)`` is the value "before training" (0 with warm-up).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from model_utils.config.options import MASTER_WEIGHTS, OPTIMIZERS
from model_utils.config.sections import OptimConfig
from model_utils.precision.master_weights import MasterWeightAdamW

# torch's and torchao's AdamW default, named so both optimizers are built with the same value.
ADAM_EPS = 1e-8

LR_DECAY_STYLES: tuple[str, ...] = ("cosine", "linear", "constant")

# Leaf parameter names that are never decayed even if they are not 1-D. Transformer Engine
# names its fused norm parameters ``layer_norm_weight`` / ``layer_norm_bias`` and its linear
# biases ``bias`` / ``fc1_bias`` / ``query_bias`` ...; HF uses ``*.weight`` on norm modules (1-D).
_NO_DECAY_LEAF_SUFFIXES: tuple[str, ...] = ("bias", "layer_norm_weight", "layer_norm_bias")


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """True for parameters that weight decay must not touch: norm gains/shifts and biases.

    The rule is shape first, name second:
    - ``param.ndim < 2``: RMSNorm/LayerNorm weights and all biases are vectors. For FSDP2 the
      parameter is a DTensor whose ``ndim`` is the *global* rank, so sharding does not change
      the answer.
    - the leaf name ends in ``bias`` or is a TE fused-norm name (``layer_norm_weight``), to be
      safe for implementations that store such vectors with an extra dimension.

    Embeddings (``embed_tokens.weight``) and ``lm_head.weight`` are 2-D and *are* decayed, as
    in Llama/torchtitan practice (torchtitan applies one weight decay to every parameter); the
    embedding is a learned matrix like any linear and decaying it keeps its norm in check.
    """
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim < 2 or leaf.endswith(_NO_DECAY_LEAF_SUFFIXES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed and a non-decayed AdamW group.

    Every trainable parameter appears exactly once (``named_parameters`` removes duplicates, so
    a tied ``lm_head``/``embed_tokens`` weight is listed once, under its first name). Each group
    carries ``param_names`` so logs and tests can see the decision; torch's optimizers keep
    unknown group keys, and they survive ``optimizer.state_dict()``.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    groups: list[dict[str, Any]] = [  # indexed by is_no_decay: decayed, then not decayed
        {"params": [], "weight_decay": weight_decay, "param_names": []},
        {"params": [], "weight_decay": 0.0, "param_names": []},
    ]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        group = groups[is_no_decay(name, param)]
        group["params"].append(param)
        group["param_names"].append(name)
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    optimizer: str = "adamw",
    master_weights: str = "params",
    master_adam: Callable[..., torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` (``--optimizer``): the same groups, lr, betas, eps and
    decoupled weight decay whichever the choice; only how the two moments are stored differs.
    With ``master_weights="optimizer"`` (bf16 parameters) the fp32 master copies live in the
    optimizer: ``master_adam`` (TE's FusedAdam, from the TE backend on CUDA) or, where none is
    given, master_weights.MasterWeightAdamW, the same algorithm in torch ops.

    - ``adamw``: torch's AdamW, fp32 moments (8 bytes per parameter), with the fused kernel
      where torch has one. Fused AdamW exists for CUDA and (since torch 2.4) CPU; on CUDA it
      is torch's fastest AdamW, on CPU it ties with ``foreach``
      (benchmarks/bench_optim_kernels.py times the two).
      If a device or tensor subclass is not supported by the fused kernel, torch raises at
      construction and we fall back to ``foreach`` (the torch default where it applies).
    - ``adamw8bit`` / ``adamw_fp8``: torchao's AdamW8bit / AdamWFp8 (see :func:`low_bit_adamw`).
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    adam = {"lr": lr, "betas": (beta1, beta2), "eps": ADAM_EPS}  # the same whichever the choice
    if optimizer != "adamw":
        return low_bit_adamw(optimizer)(groups, **adam)
    if master_weights == "optimizer":
        return (master_adam or MasterWeightAdamW)(groups, **adam)
    if master_weights != "params":
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}, got {master_weights!r}")
    try:
        return torch.optim.AdamW(groups, **adam, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(groups, **adam, foreach=None)


@functools.cache
def low_bit_adamw(optimizer: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit (``adamw8bit``) or AdamWFp8 (``adamw_fp8``), step made cache-safe.

    torchao (torchao/optim/adam.py) keeps ``exp_avg``/``exp_avg_sq`` as tensor subclasses:
    OptimState8bit (uint8 codes through a dynamic quantile map + one fp32 scale per 256-value
    block: 1 + 4/256 bytes per value) or OptimStateFp8 (float8_e4m3fn codes + a scale per
    block). Tensors under 4096 values, or whose size is not a multiple of the block, stay fp32
    (``_new_buffer``): on the Llama shapes only norm gains can (a width or shard under 4096).
    With FSDP2 each state is a DTensor over this rank's shard (``DTensor.from_local``), so it
    shards, saves and reshards like its parameter. The update is ``single_param_adam`` (fp32
    math, decoupled decay ``p -= lr * wd * p``, the same as torch's AdamW), run by
    ``torch.compile`` per parameter shape: the first step compiles (seconds), later steps reuse
    it. Each group's lr becomes a 0-d fp32 tensor (``add_param_group``), which LambdaLR fills in
    place.

    Why the subclass: torch's AOT-autograd cache keys a DTensor by its spec (mesh, placements,
    shape, stride, dtype; ``DTensor._stable_hash_for_caching``), not by the subclass inside it,
    and torchao's subclasses define no ``_stable_hash_for_caching``. So with a shared inductor
    cache (the default ``/tmp/torchinductor_<user>``) an adamw_fp8 process loads the compiled
    step an adamw8bit process saved for the same shapes and crashes ("'OptimStateFp8' object
    has no attribute 'qmap'"), and the reverse. The step therefore runs with the AOT-autograd
    cache off (``torch._functorch.config.enable_autograd_cache``); inductor's FX graph cache,
    keyed by the real inner tensors (uint8 vs float8 codes), still serves later processes.
    """
    from torchao.optim import AdamW8bit, AdamWFp8

    base = {"adamw8bit": AdamW8bit, "adamw_fp8": AdamWFp8}[optimizer]

    def step(self, closure=None):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return base.step(self, closure)

    return type(base.__name__, (base,), {"step": step, "__module__": __name__})


def describe(optimizer: torch.optim.Optimizer) -> str:
    """The start-up line's name for the optimizer that runs (which class, from which library)
    and whether it keeps fp32 master weights: TE's FusedAdam and MasterWeightAdamW both say so
    through their ``master_weights`` attribute."""
    kind = type(optimizer)
    keeps = getattr(optimizer, "master_weights", False)
    masters = ", fp32 master weights in the optimizer" if keeps else ""
    return f"{kind.__module__}.{kind.__qualname__}{masters}"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in optimizer state, counted from the tensors (:func:`local_bytes`)."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor on this rank: a DTensor by its local shard, a tensor subclass
    (torchao's OptimState8bit/Fp8) by the inner tensors it stores (codes, scales and the 8-bit
    quantile map), a plain tensor by its elements."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(tensor, DTensor):
        return local_bytes(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(local_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def _check_schedule(lr: float, min_lr: float, warmup: int, max_steps: int, style: str) -> None:
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"lr decay style must be one of {LR_DECAY_STYLES}, got {style!r}")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr must be in [0, lr={lr}], got {min_lr}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, max_steps: int, style: str) -> float:
    """Learning rate used by optimizer step ``step`` (1-based; 0 means before training).

    - ``step <= warmup``: linear warm-up ``lr * step / warmup``: step 1 trains at
      ``lr / warmup`` (small but not a wasted step), step ``warmup`` at exactly ``lr``.
    - ``warmup < step <= max_steps``: ``progress = (step - warmup) / (max_steps - warmup)``
      goes from 0 to 1 and the lr goes from ``lr`` to ``min_lr``: cosine
      ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``, linear
      ``lr - (lr - min_lr) * progress``, constant ``lr``. The last step trains at ``min_lr``.
    - ``step > max_steps`` (e.g. a resumed run that extends training): stays at ``min_lr``
      (``lr`` for constant).
    """
    _check_schedule(lr, min_lr, warmup, max_steps, style)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    decay_steps = max_steps - warmup
    if decay_steps <= 0 or step >= max_steps:
        return min_lr
    progress = (step - warmup) / decay_steps
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress


class LrMultiplier:
    """The LambdaLR callable: ``lr_at(scheduler_steps_done + 1) / lr``.

    A class, not a lambda or closure, so that ``LambdaLR.state_dict()`` stores its settings
    (LambdaLR saves the ``__dict__`` of callable objects and silently drops plain functions)
    and the state is plain floats/ints/str, which pickle and DCP handle. Note that
    ``LambdaLR.load_state_dict`` therefore restores the *checkpointed* schedule settings too:
    a resumed run continues exactly the schedule it started with.
    """

    def __init__(self, *, lr: float, min_lr: float, warmup: int, max_steps: int, style: str):
        _check_schedule(lr, min_lr, warmup, max_steps, style)
        self.lr, self.min_lr, self.warmup = lr, min_lr, warmup
        self.max_steps, self.style = max_steps, style

    def __call__(self, steps_done: int) -> float:
        # LambdaLR calls this with last_epoch = number of scheduler.step() calls so far; the
        # optimizer step about to run is number steps_done + 1 (1-based). The instance holds
        # exactly lr_at's five settings (its __dict__ is the saved state).
        return lr_at(steps_done + 1, **vars(self)) / self.lr


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    lr: float,
    min_lr: float,
    warmup: int,
    max_steps: int,
    style: str,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose lr during optimizer step N equals ``lr_at(N, ...)``.

    Call order in the loop: ``optimizer.step(); scheduler.step()``. The optimizer's groups must
    have been created with ``lr=lr`` (LambdaLR multiplies each group's initial lr).
    """
    for group in optimizer.param_groups:
        initial = group.get("initial_lr", group["lr"])
        if not math.isclose(float(initial), float(_typed_lr(lr, initial)), rel_tol=1e-12):
            raise ValueError(f"optimizer group lr {float(initial)} differs from schedule lr {lr}")
    multiplier = LrMultiplier(lr=lr, min_lr=min_lr, warmup=warmup, max_steps=max_steps, style=style)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=multiplier)


def spent_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, explicit: Mapping[str, float]) -> str:
    """Why an --lr given on a resume changes nothing ("": it applies): the saved schedule has
    decayed to its --min_lr, where it stays (the resume line says the --lr is in use)."""
    schedule = scheduler.lr_lambdas[0]
    if "lr" not in explicit or schedule.style == "constant":
        return ""
    if scheduler.last_epoch < schedule.max_steps:
        return ""
    return (
        f"--lr {explicit['lr']:g} changes nothing: the saved schedule reached --min_lr "
        f"{schedule.min_lr:g} at step {schedule.max_steps} (its first --max_steps) and stays "
        "there; give --min_lr to train on at another lr"
    )


def resume_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, explicit: dict[str, float]
) -> dict[str, float]:
    """The schedule of a resumed run; returns the peak and final lr now in use.

    ``LambdaLR.load_state_dict`` has restored the saved schedule. The rule: ``--lr``/``--min_lr``
    given explicitly on the resuming command line replace the saved ones from the resumed step
    on (e.g. to continue a diverged run at a lower lr); not given, the saved ones stay, so a
    default never silently changes a running schedule. Warm-up, decay style and schedule length
    stay the saved ones. ValueError if the result is not a valid schedule."""
    multiplier = scheduler.lr_lambdas[0]
    lr = float(explicit.get("lr", multiplier.lr))
    min_lr = float(explicit.get("min_lr", multiplier.min_lr))
    _check_schedule(lr, min_lr, multiplier.warmup, multiplier.max_steps, multiplier.style)
    multiplier.lr, multiplier.min_lr = lr, min_lr
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [_typed_lr(lr, group["lr"]) for group in groups]
    for group, base in zip(groups, scheduler.base_lrs, strict=True):
        group["initial_lr"] = _copy_lr(base)
        next_lr = base * multiplier(scheduler.last_epoch)  # the next step's lr, as LambdaLR does
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(next_lr)  # torchao's groups hold the lr as a tensor, in place
        else:
            group["lr"] = next_lr
    scheduler._last_lr = [_copy_lr(group["lr"]) for group in groups]
    return {"lr": lr, "min_lr": min_lr}


def _typed_lr(lr: float, like: float | torch.Tensor) -> float | torch.Tensor:
    """`lr` as the optimizer holds it: a float, or (torchao) a 0-d tensor of that dtype, built
    the way torchao builds it from the float, so the schedule computes the same bits as in the
    uninterrupted run."""
    return torch.tensor(lr, dtype=like.dtype) if isinstance(like, torch.Tensor) else lr


def _copy_lr(value: float | torch.Tensor) -> float | torch.Tensor:
    return value.clone() if isinstance(value, torch.Tensor) else value


def from_config(
    model: nn.Module,
    optim: OptimConfig,
    max_steps: int,
    master_adam: Callable[..., torch.optim.Optimizer] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (--optimizer, --master_weights) and its LR schedule over `max_steps` from the
    run's optim section (one place for every caller); ``master_adam`` is the backend's
    (``backend.master_weight_adam``)."""
    optimizer = build_optimizer(
        model,
        optim.lr,
        optim.weight_decay,
        optim.beta1,
        optim.beta2,
        optim.optimizer,
        optim.master_weights,
        master_adam,
    )
    scheduler = build_scheduler(
        optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        warmup=optim.warmup,
        max_steps=max_steps,
        style=optim.lr_decay_style,
    )
    return optimizer, scheduler
