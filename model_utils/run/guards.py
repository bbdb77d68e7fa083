"""Non-finite steps: a diverged step never reaches a checkpoint, and every rank stops at the
same step with one line and exit status 3.

Every rank must stop at the same step for the same reason, and the host must not wait for the
device at every step. So the checks accumulate on the device (no ``.item()``), and the ranks
agree on them with one small all-reduce at the steps where the loop already waits: report steps
(the loss is synchronised there anyway) and checkpoint saves (a save is itself a collective).
(The run lock is in run_lock.py, the write and space probes in outputs.py.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from model_utils.errors import Refusal, exit_refused
from model_utils.parallel.distributed import local_shard, unwrapped
from model_utils.precision import master_weights

if TYPE_CHECKING:
    from model_utils.checkpoint import Checkpointer

# Encodes "first non-finite step" so that a MAX all-reduce yields the earliest one over ranks.
_NO_STEP = 2**62

# train.py's exit status when training diverged (2 is bad input, 1 an unexpected error).
EXIT_DIVERGED = 3


class Diverged(RuntimeError):
    """The loss, the gradient norm or the weights stopped being finite: the run cannot go on.

    `latest` is the newest published checkpoint (all finite: every save is checked first)."""

    def __init__(self, step: int, latest: Path | None = None) -> None:
        super().__init__(f"non-finite loss, gradient norm or weights at step {step}")
        self.step, self.latest = step, latest


def exit_diverged(exc: Diverged, lr: float, is_main: bool) -> None:
    """Rank 0 prints the one line (what happened, what was kept, what to do); every rank exits
    with EXIT_DIVERGED."""
    lower = f"with a lower --lr (was {lr:g})"
    if exc.latest is None:  # a resume keeps the saved warm-up: only a new run can lengthen it
        what = f"no checkpoint was saved; start again {lower} or a longer --warmup"
    else:
        what = f"every checkpoint is finite: resume from the newest, {exc.latest}, {lower}"
    refusal = Refusal(
        f"training diverged: the loss or gradient norm is NaN/inf at step {exc.step}, so the run "
        f"stopped and saved nothing from that step on; {what}"
    )
    refusal.exit_code = EXIT_DIVERGED
    exit_refused(refusal, is_main=is_main)


class StepGuard:
    """Tracks, on the device, the first step whose loss or gradient norm was NaN/inf.

    ``observe`` queues two tiny kernels per step and never synchronises; ``agree`` is the only
    host sync, one all-reduce of two integers that every rank calls at the same steps. The stop
    request (a signal that reached some ranks) rides along in the same all-reduce, so the
    preemption check costs nothing extra either.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet

    def observe(self, step: int, *values: torch.Tensor | None) -> None:
        """Remember `step` if any of `values` (loss, grad norm, ...) is not finite."""
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for value in values:
            if value is not None:
                finite = finite & torch.isfinite(_checkable(value.detach().to(self.device))).all()
        self.first_bad.masked_fill_((self.first_bad == 0) & ~finite, step)

    def observe_weights(self, step: int, params: Iterable[torch.Tensor]) -> None:
        """Before a save: the weights themselves (a finite loss can still leave NaN weights when
        an inf gradient is not clipped). Local shards only: no communication."""
        self.observe(step, *(unwrapped(local_shard(p.detach())) for p in params))

    def agree(self, stop_requested: bool) -> tuple[bool, int | None]:
        """(any rank asked to stop, first non-finite step on any rank or None); all ranks call."""
        bad = torch.where(self.first_bad > 0, _NO_STEP - self.first_bad, 0)
        flags = torch.stack([torch.tensor(int(stop_requested), device=self.device), bad])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, encoded = (int(v) for v in flags.tolist())
        return bool(stop), (_NO_STEP - encoded) if encoded else None


def _checkable(tensor: torch.Tensor) -> torch.Tensor:
    """torch has no isfinite for float8, so the check would itself fail on a float8 tensor
    (docs/failures.md); fp16 holds every float8 value, NaN and inf included. A TE FP8
    parameter (--fp8_weights) is checked as its value."""
    if master_weights.is_quantized(tensor):
        return tensor.dequantize()
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.to(torch.float16)
    return tensor


def check_step(
    guard: StepGuard,
    ckpt: Checkpointer,
    step: int,
    model: torch.nn.Module,
    *,
    stop_requested: bool,
    saving: bool,
) -> bool:
    """Every rank agrees whether to stop (a signal reached some rank) and whether any step so
    far was non-finite; raises Diverged for the latter, after finishing an earlier (finite)
    async save. Before a save (periodic, or the preemption one) the weights are checked too, so
    no checkpoint ever holds NaN/inf and pruning never runs after a non-finite step."""
    if saving:
        guard.observe_weights(step, model.parameters())
    stop, bad_step = guard.agree(stop_requested)
    if stop and not saving:  # the preemption save needs the same weight check
        guard.observe_weights(step, model.parameters())
        bad_step = guard.agree(False)[1]
    if bad_step is not None:
        ckpt.close()
        raise Diverged(bad_step, ckpt.latest())
    return stop
