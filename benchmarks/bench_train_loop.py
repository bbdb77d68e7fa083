"""Benchmark (b): train.py's training throughput against a bare forward/backward/optimizer loop.

    .venv/bin/python benchmarks/bench_train_loop.py                     # tiny preset, bf16
    .venv/bin/python benchmarks/bench_train_loop.py --fp8 1 --rounds 3
    .venv/bin/python benchmarks/bench_train_loop.py -- --train_batch_size 4   # extra train.py flags

What is compared, in one process and alternating round by round so that both sides see the
same machine load:
- train.py: its real ``main()`` with the given flags (data pipeline on the bundled corpus, grad
  clipping, LR schedule, loss all-reduce, log lines, JSONL, preemption check). Its tokens/s is
  read from the JSONL it writes: the wall-clock ``time`` of the record at the end of the warm-up
  and of the last step, and the tokens in between. Wall clock, not the step timings train.py
  reports, so any work between steps (logging, collectives) counts against train.py.
- bare: the same model built by the same code (modeling.build -> precision backend -> FSDP2 on
  a one-rank mesh -> materialize), the same optimizer and batch shape, one pre-made random batch
  already on the device, and only ``forward; backward; optimizer.step; zero_grad`` per step.

Both sides are also measured in tokens per CPU-second of this process (all threads), which other
jobs on a shared machine disturb far less than wall clock; with ``--threads 1`` and an idle
machine the two agree. Goal: train.py / bare >= 0.97. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from model_utils import arguments, distributed, metrics, modeling, optim, precision  # noqa: E402

GOAL = 0.97


@dataclass(frozen=True)
class Measurement:
    tokens_per_sec: float  # per device, wall clock over the measured steps
    tokens_per_cpu_sec: float  # per device, per CPU-second of this process (all threads)
    measured_steps: int
    reported_median: float | None = None  # train.py's own median tokens/s/device (JSONL)
    data_wait_pct: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_train_py(train_argv: list[str], warmup: int) -> Measurement:
    """train.main() on the given flags; throughput from the wall-clock stamps in its JSONL."""
    with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as out:
        train.main([*train_argv, "--output_dir", out])
        records = metrics.read_jsonl(Path(out) / "metrics.jsonl")
    steps = [r for r in records if r.get("kind") == "train"]
    start = next((r for r in steps if r["step"] == warmup), None)
    if start is None:
        raise SystemExit(
            f"train.py logged no record at step {warmup}: use --logging_freq dividing the warm-up"
        )
    after = [r for r in steps if r["step"] > warmup]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tokens = sum(r["tokens"] for r in after)
    seconds = after[-1]["time"] - start["time"]
    cpu_seconds = after[-1]["process_cpu_seconds"] - start["process_cpu_seconds"]
    summary = metrics.summarize(records, warmup)
    return Measurement(
        tokens_per_sec=tokens / seconds / world_size,
        tokens_per_cpu_sec=tokens / cpu_seconds / world_size,
        measured_steps=after[-1]["step"] - warmup,
        reported_median=summary["tokens_per_sec_per_device"],
        data_wait_pct=summary["data_wait_pct"],
    )


def run_bare_loop(train_argv: list[str], warmup: int) -> Measurement:
    """The minimal loop on the model, precision and batch shape that ``train_argv`` selects."""
    args = arguments.parse_args(train_argv)
    args.model_impl = precision.resolve_model_impl(args.model_impl)
    precision.resolve_fp8_recipe(args)
    world = distributed.world_from_env()
    device = distributed.device_for(world)
    distributed.init(world, device, args.dist_timeout)
    try:
        torch.manual_seed(args.seed)
        mesh = distributed.build_mesh(world, device, args.sharding_strategy)
        backend = precision.build_backend(args, device, dp_group=dist.group.WORLD)
        model = backend.prepare(modeling.build(args, args.model_impl, device))
        if args.activation_checkpointing:
            distributed.apply_activation_checkpointing(model, backend.checkpoint_fn)
        if args.compile:
            distributed.apply_compile(model)
        model = distributed.shard(model, mesh, args)
        modeling.materialize(model, device, args.seed)
        optimizer = optim.build_optimizer(model, args.lr, args.weight_decay, args.beta1, args.beta2)
        shape = (args.train_batch_size, args.max_context_width)
        input_ids = torch.randint(0, args.vocab_size, shape, device=device)
        model.train()
        start = start_cpu = 0.0
        for step in range(1, args.max_steps + 1):
            for micro in range(args.grad_accum_steps):
                with backend.autocast():
                    loss = model(
                        input_ids=input_ids, labels=input_ids, **backend.forward_kwargs(micro)
                    ).loss
                (loss / args.grad_accum_steps).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            backend.after_optimizer_step(model)
            if step == warmup:
                _sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
        _sync(device)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - start_cpu
        measured = args.max_steps - warmup
        tokens = measured * args.grad_accum_steps * shape[0] * shape[1]
        return Measurement(
            tokens_per_sec=tokens / seconds,
            tokens_per_cpu_sec=tokens / cpu_seconds,
            measured_steps=measured,
        )
    finally:
        distributed.cleanup()


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--fp8", default="0", choices=("0", "1"))
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument(
        "--speed_warmup", type=int, default=10, help="first steps excluded from the measurement"
    )
    p.add_argument("--rounds", type=int, default=2, help="bare/train.py pairs, alternating")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for both sides (0: torch's default); 1 is steadier on a "
        "machine shared with other jobs",
    )
    p.add_argument("extra", nargs="*", help="after --: more train.py flags (used by both sides)")
    opts = p.parse_args(argv)
    if not 0 < opts.speed_warmup < opts.steps or opts.rounds < 1:
        p.error("need 0 < --speed_warmup < --steps and --rounds >= 1")
    train_argv = [
        "--preset", opts.preset, "--fp8", opts.fp8, "--max_steps", str(opts.steps),
        *opts.extra,
    ]  # fmt: skip
    return opts, train_argv


def main(argv: list[str] | None = None) -> None:
    opts, train_argv = parse(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    bare: list[Measurement] = []
    real: list[Measurement] = []
    for round_index in range(opts.rounds):
        print(f"== round {round_index + 1}/{opts.rounds}: bare loop", flush=True)
        bare.append(run_bare_loop(train_argv, opts.speed_warmup))
        print(f"== round {round_index + 1}/{opts.rounds}: train.py {' '.join(train_argv)}")
        with contextlib.redirect_stderr(sys.stdout):
            real.append(run_train_py(train_argv, opts.speed_warmup))

    print("\n== bench_train_loop: train.py vs bare forward/backward/optimizer loop")
    print(f"command: {command}")
    print(f"train.py flags: {' '.join(train_argv)}  (warm-up {opts.speed_warmup} steps excluded)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for i, (b, r) in enumerate(zip(bare, real, strict=True), start=1):
        print(
            f"  round {i}: wall clock: bare {b.tokens_per_sec:,.0f} tok/s, train.py "
            f"{r.tokens_per_sec:,.0f} tok/s (its own median {r.reported_median:,.0f}, data wait "
            f"{r.data_wait_pct:.1f}%), ratio {r.tokens_per_sec / b.tokens_per_sec:.3f}; "
            f"per CPU-second: bare {b.tokens_per_cpu_sec:,.0f}, train.py "
            f"{r.tokens_per_cpu_sec:,.0f}, ratio {r.tokens_per_cpu_sec / b.tokens_per_cpu_sec:.3f}"
        )
    for label, key in (("wall clock", "tokens_per_sec"), ("per CPU-second", "tokens_per_cpu_sec")):
        bare_tps = statistics.median(getattr(m, key) for m in bare)
        real_tps = statistics.median(getattr(m, key) for m in real)
        ratio = real_tps / bare_tps
        verdict = "meets" if ratio >= GOAL else "MISSES"
        print(
            f"{label} (median over rounds): bare {bare_tps:,.0f}, train.py {real_tps:,.0f} "
            f"tokens/device -> ratio {ratio:.3f} ({verdict} the goal >= {GOAL})"
        )
    print(
        "On a machine shared with other jobs the wall-clock ratio swings with their load; the "
        "per-CPU-second ratio (use --threads 1) measures the work each loop does per token."
    )


if __name__ == "__main__":
    main()
