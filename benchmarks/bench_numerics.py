"""What ``--fp8_numerics`` costs: a report step's measuring, and what that is per step.

    .venv/bin/python -m benchmarks.bench_numerics                        # small Llama, CPU, torchao
    .venv/bin/python -m benchmarks.bench_numerics --steps 40 --rounds 3

In one process, alternating round by round so both sides see the same machine: train.py's
``main()`` on a small FP8 run with ``--logging_freq 1``, without and with ``--fp8_numerics``
(every step is then a report step that measures: the worst case). Per-step times come from
metrics.jsonl's timestamps (benchmarks/bench_profiler_cost.py's method). The cost of a report
step is the ratio of the medians; at ``--logging_freq N`` a run pays it once every N steps.
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks._common import options
from benchmarks.bench_profiler_cost import SMALL, step_seconds


def main(argv: list[str] | None = None) -> None:
    parser = options(__doc__, steps=30, rounds=2, speed_warmup=5)
    if (args := parser.parse_args(argv)).speed_warmup >= args.steps:
        parser.error("--speed_warmup must be below --steps")
    base = [*SMALL, "--fp8=1", *args.extra, "--max_steps", str(args.steps)]
    off, on = [], []
    for _ in range(args.rounds):
        off += step_seconds(base, args.speed_warmup, args.steps)
        on += step_seconds([*base, "--fp8_numerics"], args.speed_warmup, args.steps)
    plain, measured = statistics.median(off), statistics.median(on)
    extra = measured / plain - 1
    print(f"steps measured per side: {len(off)} ({args.rounds} rounds)")
    print(f"median step without --fp8_numerics: {plain * 1000:8.1f} ms")
    print(f"median step measuring every step:   {measured * 1000:8.1f} ms ({1 + extra:.3f}x)")
    for every in (1, 10, 100):
        print(f"  at --logging_freq {every:>3}: +{100 * extra / every:.2f}% per step")


if __name__ == "__main__":
    main(sys.argv[1:])
