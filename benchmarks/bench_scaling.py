"""Benchmark: data-parallel scaling of train.py, 2 ranks against 1 rank, tokens per second.

    .venv/bin/python -m benchmarks.bench_scaling                       # tiny preset, bf16
    .venv/bin/python -m benchmarks.bench_scaling --rounds 3 --steps 60
    .venv/bin/python -m benchmarks.bench_scaling -- --fp8=1 --fp8_all_gather=1   # more flags

What runs: train.py itself under `torchrun --nproc_per_node=N` (gloo on CPU, FSDP2, the bundled
corpus sharded per rank, loss all-reduce per logged step), N = 1 and N = 2 alternating round by
round so both see the same machine load. Each rank keeps the preset's micro-batch, so 2 ranks
process twice the tokens per step (weak scaling, as on a cluster).

Fair comparison on a 2-core machine: every rank gets exactly one thread (OMP_NUM_THREADS=1, which
torchrun also sets for N > 1), so 1 rank x 1 thread vs 2 ranks x 1 thread isolates what
distribution costs (all-gathers, reduce-scatters, the loss all-reduce, stragglers). Comparing
against 1 rank x 2 threads would instead measure how well torch's intra-op threading scales.

A third configuration, two independent 1-rank jobs at once (no communication), measures what the
machine gives two busy processes (shared caches, memory bandwidth, other users): the ratio of
the 2-rank job to it is the cost of distribution alone.

Throughput comes from train.py's JSONL, two ways: wall clock (the global tokens logged after the
warm-up step over the time from the warm-up record to the last record: everything counts) and
median step (tokens per step over the median step time, collectives and data wait included:
robust to bursts from other jobs on a shared machine). Per-rank efficiency =
(tokens/s with 2 ranks / 2) / (tokens/s with 1 rank). Goal: >= 0.9. Not a test: it depends on
what else the machine runs (the load average is printed with the result).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import COUNT, ROOT, free_port, options
from model_utils.report import metrics

TORCHRUN = Path(sys.executable).with_name("torchrun")
GOAL = 0.9
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_command(nproc: int, train_argv: list[str], out_dir: Path) -> list[str]:
    launch = f"--nproc_per_node={nproc} --master_addr=127.0.0.1 --master_port={free_port()}"
    train_py = [str(ROOT / "train.py"), *train_argv, "--output_dir", str(out_dir)]
    return [str(TORCHRUN), *launch.split(), *train_py]


@dataclass(frozen=True)
class Throughput:
    """Global tokens/s of one launch after warm-up, two ways."""

    wall: float  # logged tokens / wall time between the warm-up record and the last record
    step_median: float  # tokens per step / median step time: robust to other jobs' bursts


def throughput(records: list[dict], warmup: int) -> Throughput:
    train = [r for r in records if r.get("kind") == "train"]
    start = next((r for r in train if r["step"] == warmup), None)
    after = [r for r in train if r["step"] > warmup]
    if start is None or not after:
        raise SystemExit(f"no train records around step {warmup}: is --logging_freq 1?")
    wall = sum(r["tokens"] for r in after) / (after[-1]["time"] - start["time"])
    step = statistics.median(r["step_seconds"] for r in after)
    return Throughput(wall=wall, step_median=after[-1]["tokens"] / step)


def run(
    nproc: int, train_argv: list[str], warmup: int, threads: int, copies: int = 1
) -> Throughput:
    """`copies` independent torchrun launches of train.py at once; their throughputs summed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        outs = [Path(tmp) / f"job{i}" for i in range(copies)]
        cmds = [torchrun_command(nproc, train_argv, out) for out in outs]
        logged = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, **logged) for cmd in cmds]
        for cmd, proc in zip(cmds, procs, strict=True):
            log, _ = proc.communicate()
            if proc.returncode != 0:
                sys.stderr.write(log[-3000:])
                raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}")
        results = [throughput(metrics.read_jsonl(out / "metrics.jsonl"), warmup) for out in outs]
    return Throughput(
        wall=sum(r.wall for r in results), step_median=sum(r.step_median for r in results)
    )


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = options(__doc__, steps=30, speed_warmup=5, rounds=3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--threads", type=COUNT, default=1, help="OMP_NUM_THREADS of every rank")
    opts = p.parse_args(argv)
    if opts.speed_warmup >= opts.steps:
        p.error("--speed_warmup must be below --steps")
    flags = f"--preset {opts.preset} --max_steps {opts.steps} --logging_freq 1 --warmup 2"
    return opts, [*flags.split(), "--validation_batches", "1", *opts.extra]


# (label, ranks per job, concurrent independent jobs)
CONFIGS = (("1 rank", 1, 1), ("2 ranks", 2, 1), ("2 x 1 rank, independent", 1, 2))


def main(argv: list[str] | None = None) -> None:
    opts, train_argv = parse(argv)
    command = shlex.join([sys.executable, *sys.argv])
    load_before = os.getloadavg()
    results: dict[str, list[Throughput]] = {label: [] for label, _, _ in CONFIGS}
    for round_index in range(1, opts.rounds + 1):
        for label, nproc, copies in CONFIGS:
            start = time.perf_counter()
            t = run(nproc, train_argv, opts.speed_warmup, opts.threads, copies)
            results[label].append(t)
            print(
                f"round {round_index}: {label} ({opts.threads} thread each): "
                f"{t.wall:,.0f} tokens/s wall clock, {t.step_median:,.0f} from the median step "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    print("\n== bench_scaling: train.py data-parallel scaling (gloo, CPU)")
    print(f"command: {command}")
    print(f"per launch: torchrun --nproc_per_node=N train.py {shlex.join(train_argv)}")
    print(
        f"threads per rank: {opts.threads}; cores: {os.cpu_count()}; warm-up excluded: "
        f"{opts.speed_warmup} steps; load average before/after: "
        f"{load_before[0]:.1f}/{os.getloadavg()[0]:.1f}"
    )
    for key in ("step_median", "wall"):
        med = {k: statistics.median(getattr(t, key) for t in v) for k, v in results.items()}
        one, two, pair = med["1 rank"], med["2 ranks"], med["2 x 1 rank, independent"]
        efficiency = two / 2 / one
        verdict = "meets" if efficiency >= GOAL else "MISSES"
        print(
            f"[{key}] median of {opts.rounds}: 1 rank {one:,.0f} tokens/s; 2 ranks {two:,.0f} "
            f"({two / 2:,.0f} per rank); 2 independent 1-rank jobs {pair:,.0f} in total"
        )
        print(
            f"  per-rank efficiency {efficiency:.3f} ({verdict} the goal >= {GOAL}); "
            f"machine ceiling (2 independent jobs / 2 x 1 rank) {pair / 2 / one:.3f}; "
            f"distribution cost alone (2 ranks / 2 independent jobs) {two / pair:.3f}"
        )


if __name__ == "__main__":
    main()
