"""What ``--profile_steps`` costs the steps outside its window: nothing measurable, by design.

    .venv/bin/python -m benchmarks.bench_profiler_cost                      # small Llama, CPU
    .venv/bin/python -m benchmarks.bench_profiler_cost --steps 40 --rounds 3 -- --fp8=1

In one process, alternating round by round so both sides see the same machine:
- off: train.py's ``main()`` on the tiny run, no flag;
- on, outside the window: the same run with ``--profile_steps N:N`` (N = the last step). The
  profiler starts at step N-1 (its warm-up), so every step before is a step of a run that has
  the flag but no profiler yet: the loop's ``RunProfiler.step`` and the step's annotations,
  which are ``nullcontext`` while no profiler records.
Per-step times come from metrics.jsonl's timestamps (``--logging_freq 1``): the difference of
consecutive records, so all the loop's work between steps counts. Steps up to
``--speed_warmup`` and the last two (the window) are dropped; the median and the best decile
(90th percentile of tokens/s, the steadier figure on a shared machine) are compared.

"No code at all" cannot run in the same process (the annotations are in the step), so its
difference is bounded instead: the cost of one disabled ``annotate()`` call, timed, times the
calls per step (data_wait, forward, backward, lm_head and optimizer per micro-batch or step),
as a share of the median step. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import statistics
import sys
import timeit

from benchmarks._common import best_decile, options, train_in_process
from model_utils.model.annotate import annotate

#: The tiny preset cut to a fraction of a second per step on 2 busy cores (tests/helpers/runs.py's
#: SMALL_LLAMA): the loop's own overheads weigh most in a short step.
SMALL = (
    "--preset tiny --hidden_width 64 --num_layers 2 --num_heads 4 --num_key_value_heads 2 "
    "--intermediate_size 128 --max_context_width 32 --train_batch_size 4"
).split()


def step_seconds(argv: list[str], warmup: int, last: int) -> list[float]:
    """train.main() on ``argv``; seconds of steps warmup+1 .. last, from the JSONL stamps."""
    records = train_in_process([*argv, "--logging_freq", "1", "--checkpoint_freq", "-1"])
    stamps = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    return [stamps[s] - stamps[s - 1] for s in range(warmup + 1, last + 1)]


def tokens_per_sec(seconds: list[float], tokens: int) -> tuple[float, float]:
    rates = [tokens / s for s in seconds]
    return statistics.median(rates), best_decile(rates)


def main(argv: list[str] | None = None) -> None:
    parser = options(__doc__, steps=30, rounds=2, speed_warmup=5)
    if (args := parser.parse_args(argv)).speed_warmup >= args.steps - 2:
        parser.error("--speed_warmup must be below --steps - 2")
    base = [*SMALL, *args.extra, "--max_steps", str(args.steps)]
    flagged = [*base, "--profile_steps", f"{args.steps}:{args.steps}"]
    last = args.steps - 2  # the profiler's warm-up step and the window are left out
    off, outside = [], []
    for _ in range(args.rounds):
        off += step_seconds(base, args.speed_warmup, last)
        outside += step_seconds(flagged, args.speed_warmup, last)
    tokens = 4 * 32
    off_med, off_best = tokens_per_sec(off, tokens)
    out_med, out_best = tokens_per_sec(outside, tokens)
    per_call = min(timeit.repeat(lambda: annotate("x").__enter__(), number=100_000, repeat=5))
    per_call /= 100_000
    calls = 5  # data_wait, forward, lm_head, backward, optimizer at one micro-batch per step
    step = statistics.median(off)
    print(
        f"steps measured per side: {len(off)} ({args.rounds} rounds of {last - args.speed_warmup})"
    )
    print(f"off:                     median {off_med:8.1f} tok/s, best decile {off_best:8.1f}")
    print(f"on, outside the window:  median {out_med:8.1f} tok/s, best decile {out_best:8.1f}")
    ratios = f"median {out_med / off_med:.3f}, best decile {out_best / off_best:.3f}"
    print(f"ratio outside/off:       {ratios}")
    print(
        f"a disabled annotate(): {per_call * 1e9:.0f} ns; x {calls} per step = "
        f"{100 * calls * per_call / step:.4f}% of the median step ({step * 1000:.1f} ms)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
