"""What naming the slow rank costs a report step: one ``RankTimes.gather`` (two float64 per
rank, one all-gather on the run's process group, plus reading the busy clock), timed on two
real gloo ranks.

    .venv/bin/python -m benchmarks.bench_rank_gather                  # 2 gloo ranks, CPU
    .venv/bin/python -m benchmarks.bench_rank_gather --calls 500

Each rank first meets the other at a barrier, then times ``--calls`` gathers back to back
(each one is a full collective, so the figure includes one round trip between the ranks) and
the busy clock alone. Rank 0 prints the median and 90th percentile per call. Not a test:
timings depend on the machine; on NCCL the gather is a 16-byte all-gather per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="gathers timed per rank")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    return args


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """(median, 90th percentile) in microseconds."""
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return statistics.median(ordered) * 1e6, p90 * 1e6


def rank_main(rank: int, world_size: int, port: int, calls: int) -> None:
    from model_utils.run.slow_rank import RankTimes, busy_seconds

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    times = RankTimes(world_size, torch.device("cpu"), threshold=1.5)
    gathers, clocks = [], []
    dist.barrier()
    for _ in range(calls):
        times.add_step(0.0)
        start = time.perf_counter()
        times.gather()
        gathers.append(time.perf_counter() - start)
        start = time.perf_counter()
        busy_seconds()
        clocks.append(time.perf_counter() - start)
    if rank == 0:
        g50, g90 = percentiles(gathers)
        c50, c90 = percentiles(clocks)
        print(
            f"{world_size} gloo ranks, {calls} report-step gathers: median {g50:.0f} us, "
            f"p90 {g90:.0f} us per gather; the busy clock alone: median {c50:.1f} us, "
            f"p90 {c90:.1f} us (torch {torch.__version__})",
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from helpers.procs import spawn_ranks

    spawn_ranks(rank_main, 2, args.calls)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, "tests")  # helpers.procs: the tests' one way of starting gloo ranks
    sys.exit(main())
