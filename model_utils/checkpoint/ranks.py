"""This process's place among the ranks, and the few collectives a checkpoint needs.

Every function works without a process group too (a world of one), so the checks that read no
tensors can run before ``torch.distributed`` is initialised.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (a world of one without a process group: [obj])."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (a collective on the default group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
