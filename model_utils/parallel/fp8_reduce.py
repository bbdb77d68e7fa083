"""FSDP2's gradient reduce-scatter with its bytes counted, and ``--reduce_dtype fp8``: 8-bit
gradients on the wire (MS-AMP's O1 gradient communication; docs/cluster.md). FSDP2 hands over
one fp32 buffer of world x chunk elements, chunk r the shard rank r keeps, and asks for an
average (torch's ``_fsdp_collectives.foreach_reduce``). Scales are per block, not per chunk: a
layer's small norm gradients keep their range beside its large matmul ones. A non-finite
gradient makes its block's scale, and so the sum, non-finite, for the step's guard to see.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup as Group
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class CountedReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter (fp32 or bf16), counting the bytes this rank sends."""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def count(self, nbytes: int, group: Group) -> None:
        """Of `nbytes` split over `group`, what leaves this rank: all but its own chunk."""
        self.bytes_sent += nbytes // group.size() * (group.size() - 1)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, op: Any, async_op=False
    ) -> dist.Work | None:
        self.count(input_tensor.numel() * input_tensor.element_size(), group)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class Fp8ReduceScatter(CountedReduceScatter):
    """Per-block scaled float8 chunks through all_to_all, summed in fp32 where received;
    synchronous (FSDP2 passes no ``async_op`` and reads the output on the same stream)."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, op: Any, async_op=False
    ) -> None:
        world = group.size()
        wire = to_wire(input_tensor.view(world, -1))
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        self.count(wire.numel(), group)
        del wire
        total = from_wire(received, output_tensor.numel())
        if op == dist.ReduceOp.AVG:
            total /= world
        elif op != dist.ReduceOp.SUM:  # PREMUL_SUM: a gradient divide factor, which no flag sets
            raise ValueError(f"the fp8 gradient reduce-scatter averages or sums, not {op}")
        output_tensor.copy_(total)


def to_wire(chunks: Tensor) -> Tensor:
    """(world, chunk) fp32 -> (world, bytes) uint8 (gloo has no float8): each destination's
    float8 values, then its blocks' fp32 dequantisation factors (amax / 448) as bytes."""
    world, chunk = chunks.shape
    # In place on the padded copy: FSDP2 runs this on its reduce-scatter stream, whose blocks
    # the compute stream cannot reuse, so each fp32 temporary of a unit's size stays reserved.
    blocks = F.pad(chunks.float(), (0, -chunk % BLOCK)).view(world, -1, BLOCK)
    factor = torch.linalg.vector_norm(blocks, float("inf"), dim=-1, keepdim=True) / FP8_MAX
    values = blocks.div_(torch.where(factor > 0, factor, 1.0)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat(
        [values.view(torch.uint8).view(world, -1), factor.view(world, -1).view(torch.uint8)], 1
    )


def from_wire(received: Tensor, chunk: int) -> Tensor:
    """What :func:`to_wire` sent from every rank -> their sum in fp32, `chunk` elements; one
    sender's row at a time, so the fp32 temporaries are two chunks, not one per rank."""
    world, blocks = received.shape[0], -(-chunk // BLOCK)
    factor = received[:, blocks * BLOCK :].contiguous().view(torch.float32).view(world, blocks, 1)
    summed = torch.zeros(blocks, BLOCK, dtype=torch.float32, device=received.device)
    for sender in range(world):
        values = received[sender, : blocks * BLOCK].view(FP8).float().view(blocks, BLOCK)
        summed.add_(values.mul_(factor[sender]))
    return summed.flatten()[:chunk]
