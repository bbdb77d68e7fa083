"""Benchmark (b): train.py's training throughput against its bare step in a loop.

    .venv/bin/python -m benchmarks.bench_train_loop                     # tiny preset, bf16
    .venv/bin/python -m benchmarks.bench_train_loop --fp8 1 --rounds 3
    .venv/bin/python -m benchmarks.bench_train_loop -- --train_batch_size 4   # extra train.py flags

What is compared, in one process and alternating round by round so that both sides see the
same machine:
- train.py: its real ``main()`` with the given flags (data pipeline on the bundled corpus, grad
  clipping, LR schedule, loss all-reduce, log lines, JSONL, preemption check). Its step times are
  read from the JSONL it writes (``--logging_freq 1``, train.py's default): the difference of the
  wall-clock ``time`` stamps of consecutive records, so all work between two steps (logging,
  collectives, data) counts against train.py, not only what train.py itself times.
- bare: the same model built by the same code (modeling.build -> precision backend -> FSDP2 on
  a one-rank mesh -> materialize), the same optimizer, schedule and batch shape, one pre-made
  random batch already on the device, and only train.py's own step per step
  (``model_utils.run.step.train_step``: forward, backward, clip, optimizer and schedule step),
  plus a device sync per step, which train.py's per-step ``loss.item()`` also does. What the
  ratio measures is therefore what train.py's loop adds around its step: data, guards, logs.

The first ``--speed_warmup`` steps of each run are dropped. Two statistics of per-step tokens/s:
the median, and the 90th percentile ("best decile"). On a machine shared with other jobs the
median swings with their load; the best decile estimates uncontended speed (a step cannot run
faster than its work allows, as with timeit's minimum) and is the steadier of the two there.
Goal: train.py / bare >= 0.97. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time

import torch

from benchmarks._common import best_decile, build_model, options, random_batch, train_in_process
from model_utils import optim
from model_utils.config import arguments
from model_utils.parallel import distributed
from model_utils.report import metrics
from model_utils.report.metrics.device import device_sync
from model_utils.run.step import StepParts, train_step

GOAL = 0.97


def run_train_py(train_argv: list[str], warmup: int) -> tuple[list[float], dict]:
    """train.main() on the given flags: tokens/s of each measured (post-warm-up) step, from the
    wall-clock stamps in its JSONL, and the run's summary."""
    records = train_in_process(train_argv)
    steps = [r for r in records if r.get("kind") == "train" and r["step"] >= warmup]
    if not steps or steps[0]["step"] != warmup or any(r["window_steps"] != 1 for r in steps):
        raise SystemExit("train.py must log every step (--logging_freq 1) for this benchmark")
    rates = [  # one process: global tokens are this device's tokens
        cur["tokens"] / (cur["time"] - prev["time"])
        for prev, cur in zip(steps, steps[1:], strict=False)
    ]
    return rates, metrics.summarize(records, warmup)


def run_bare_loop(train_argv: list[str], warmup: int) -> list[float]:
    """train.py's step alone, on the model, precision and batch shape ``train_argv`` selects:
    tokens/s of each measured step."""
    args = arguments.parse_args(train_argv)
    world = distributed.world_from_env()
    device = distributed.device_for(world)
    distributed.init(world, device, args.parallel.dist_timeout)
    try:
        torch.manual_seed(args.run.seed)
        model, backend = build_model(args, device)
        optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)
        input_ids = random_batch(args, device)
        tokens_per_step = args.optim.grad_accum_steps * input_ids.numel()
        fixed = {"input_ids": input_ids, "labels": input_ids}
        parts = StepParts(model, optimizer, scheduler, backend, args, device)
        model.train()
        sync, stamps = device_sync(device), []
        for step in range(1, args.run.max_steps + 1):
            train_step(parts, lambda: (fixed, 1.0))
            sync()
            if step >= warmup:
                stamps.append(time.perf_counter())
        return [tokens_per_step / (b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    finally:
        distributed.cleanup()


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = options(__doc__, steps=60, speed_warmup=10, rounds=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--fp8", default="0", choices=("0", "1"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    opts = p.parse_args(argv)
    if opts.speed_warmup >= opts.steps - 2:
        p.error("--speed_warmup must be below --steps - 2")
    flags = f"--preset {opts.preset} --fp8 {opts.fp8} --max_steps {opts.steps}".split()
    return opts, [*flags, *opts.extra]


def _ratio_line(label: str, bare: float, real: float) -> str:
    ratio = real / bare
    verdict = "meets" if ratio >= GOAL else "MISSES"
    return (
        f"  {label:<12} bare {bare:>9,.0f}  train.py {real:>9,.0f} tokens/s/device  "
        f"ratio {ratio:.3f} ({verdict} the goal >= {GOAL})"
    )


def main(argv: list[str] | None = None) -> None:
    opts, train_argv = parse(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("bench_train_loop.py runs one process; start it with python, not torchrun")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    bare: list[float] = []
    real: list[float] = []
    summaries: list[dict] = []
    for round_index in range(opts.rounds):
        print(f"== round {round_index + 1}/{opts.rounds}: bare loop", flush=True)
        bare += run_bare_loop(train_argv, opts.speed_warmup)
        print(f"== round {round_index + 1}/{opts.rounds}: train.py {' '.join(train_argv)}")
        with contextlib.redirect_stderr(sys.stdout):
            rates, summary = run_train_py(train_argv, opts.speed_warmup)
        real += rates
        summaries.append(summary)

    print("\n== bench_train_loop: train.py vs its step alone in a bare loop")
    print(f"command: {command}")
    print(
        f"train.py flags: {' '.join(train_argv)}; {opts.rounds} rounds, steps "
        f"{opts.speed_warmup + 1}..{opts.steps} measured ({len(bare)} per side); torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    wait = statistics.median(s["data_wait_pct"] for s in summaries)
    print(f"train.py data wait: {wait:.1f}% of step time (median)")
    print(_ratio_line("median", statistics.median(bare), statistics.median(real)))
    print(_ratio_line("best decile", best_decile(bare), best_decile(real)))


if __name__ == "__main__":
    main()
