"""One optimizer step: gradient accumulation over micro-batches, clip, AdamW, LR schedule.

train.py's loop calls it, and so do the tests and benchmarks that train or time a model, so
what they check is the step that trains, not a copy of it that could drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from model_utils.config.run_config import Config
from model_utils.model.annotate import BACKWARD, DATA_WAIT, FORWARD, OPTIMIZER, annotate
from model_utils.parallel import distributed
from model_utils.precision.backends import PrecisionBackend

#: Returns (micro-batch of CPU tensors, loss weight): data.ReadGuard.next, or a fixed batch.
MicroBatchSource = Callable[[], tuple[dict[str, torch.Tensor], float]]


@dataclass
class StepParts:
    """What one optimizer step moves, handed over as one record: the sharded model, its
    optimizer and LR schedule, the precision backend (autocast, bookkeeping after the step),
    the flags the step reads (``config.optim``, ``config.parallel``) and the device."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    backend: PrecisionBackend
    config: Config
    device: torch.device


@dataclass(frozen=True)
class StepResult:
    """What the loop needs from one step. The tensors stay on the device: reading them would
    make the host wait for the device every step (the loop reads them at report steps only)."""

    loss: torch.Tensor  # this rank's mean micro-batch loss, not yet averaged over ranks
    grad_norm: torch.Tensor | None  # before clipping; None with --grad_clip 0
    lr: float  # the lr this step used
    data_wait: float  # seconds spent waiting for micro-batches
    # False: a rank's read failed during the step (data_ok): no optimizer step, nothing to record
    stepped: bool = True


def train_step(
    parts: StepParts,
    next_micro_batch: MicroBatchSource,
    *,
    data_ok: Callable[[], bool] | None = None,
) -> StepResult:
    """One optimizer step of ``parts`` over ``config.optim.grad_accum_steps`` micro-batches.

    Each micro-batch's loss is scaled by 1/grad_accum_steps so the gradients sum to the mean,
    and by its weight (0 for data.ReadGuard's stand-in after a bad read: no gradient, yet this
    rank still joins the step's collectives). Only the first micro-batch of the step re-casts
    TE's FP8 weights (the backend's autocast); later ones reuse them.

    ``data_ok`` (data.ReadGuard.all_read), asked after the last micro-batch: False if any rank's
    read failed during the step. The step is then not taken (gradients dropped, no optimizer or
    schedule step): an update from a stand-in batch, or from part of the data, is no step a
    checkpoint should hold, and ``stepped=False`` tells the loop to record nothing.
    """
    model, backend, config, device = parts.model, parts.backend, parts.config, parts.device
    accum = config.optim.grad_accum_steps
    data_wait, loss_sum = 0.0, torch.zeros((), device=device)
    for micro in range(accum):
        start = time.perf_counter()
        with annotate(DATA_WAIT):
            raw, weight = next_micro_batch()
            micro_batch = {k: v.to(device, non_blocking=True) for k, v in raw.items()}
        data_wait += time.perf_counter() - start
        distributed.sync_gradients(model, config.parallel.sharding_strategy, micro == accum - 1)
        with annotate(FORWARD), backend.autocast(first_micro_batch=micro == 0):
            loss = model(**micro_batch).loss * weight
        with annotate(BACKWARD):
            (loss / accum).backward()
        loss_sum += loss.detach()
    lr = float(parts.scheduler.get_last_lr()[0])  # torchao keeps it as a 0-d CPU tensor
    if data_ok is not None and not data_ok():
        parts.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum / accum, None, lr, data_wait, stepped=False)
    grad_norm = None
    with annotate(OPTIMIZER):
        if config.optim.grad_clip > 0:
            grad_norm = clip_grad_norm(model, config.optim.grad_clip)
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
        backend.after_optimizer_step(model)
    return StepResult(loss_sum / accum, grad_norm, lr, data_wait)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's global-norm clip; the norm (before clipping) comes back as a plain tensor.

    On FSDP2's DTensor gradients the norm is reduced across the shards, so every rank scales
    by the same coefficient; ``full_tensor`` gives the loop the same value on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
