"""What naming the slow rank costs a report step: one ``RankTimes.gather`` (two float64 per
rank, one all-gather on the run's process group, plus reading the busy clock), timed on two
real gloo ranks.

    .venv/bin/python -m benchmarks.bench_rank_gather                  # 2 gloo ranks, CPU
    .venv/bin/python -m benchmarks.bench_rank_gather --calls 500

Each rank first meets the other at a barrier, then times ``--calls`` rounds of: one gather (a
full collective, so one round trip between the ranks is in it), the scalar loss all-reduce
every report step already does (the yardstick), and the busy clock alone. Rank 0 prints the
median and 90th percentile of each. Not a test:
timings depend on the machine; on NCCL the gather is a 16-byte all-gather per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import COUNT, free_port
from model_utils.errors import OneLineParser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=COUNT, default=200, help="gathers timed per rank")
    return parser.parse_args(argv)


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """(median, 90th percentile) in microseconds."""
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return statistics.median(ordered) * 1e6, p90 * 1e6


def rank_main(rank: int, world_size: int, port: int, calls: int) -> None:
    from model_utils.report.slow_rank import RankTimes, busy_seconds

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    times = RankTimes(world_size, torch.device("cpu"), threshold=1.5)
    gathers, clocks, losses = [], [], []
    loss = torch.zeros(())
    dist.barrier()
    for _ in range(calls):  # interleaved: both figures see the same machine
        times.add_step(0.0)
        start = time.perf_counter()
        times.gather()
        gathers.append(time.perf_counter() - start)
        start = time.perf_counter()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(time.perf_counter() - start)
        start = time.perf_counter()
        busy_seconds()
        clocks.append(time.perf_counter() - start)
    if rank == 0:
        (g50, g90), (l50, l90) = percentiles(gathers), percentiles(losses)
        c50, c90 = percentiles(clocks)
        print(
            f"{world_size} gloo ranks, {calls} calls each (torch {torch.__version__}), median / "
            f"p90 in us: slow-rank gather {g50:.0f} / {g90:.0f}; the report's loss all-reduce "
            f"beside it {l50:.0f} / {l90:.0f}; the busy clock alone {c50:.1f} / {c90:.1f}",
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mp.spawn(rank_main, args=(2, free_port(), args.calls), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
