"""What several benchmarks share: their options and the checks of their values, train.py's
model on a world of one and a random batch for it, a median of timed calls, train.py run to its
metrics records (in this process or a fresh one) and a free port. Heavy imports stay inside the
functions, so a benchmark that only launches processes does not load torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model_utils.errors import OneLineParser

ROOT = Path(__file__).resolve().parent.parent


def options(doc: str, **defaults: int) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph, the shared options it names with
    their defaults (steps: train.py steps per run; rounds: alternating its sides; speed_warmup:
    first steps left out of the timing; repeats: timed calls per measurement) and, after --,
    more train.py flags (`extra`)."""
    parser = OneLineParser(description=doc.split("\n\n")[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=COUNT, default=default)
    parser.add_argument("extra", nargs="*", help="after --: more train.py flags (every side)")
    return parser


def checked(kind: Callable[[str], Any], ok: Callable[[Any], Any], words: str) -> Callable:
    """An argparse type: `kind(text)` where `ok` holds, else one line (it must be `words`) and
    exit 2 before any work, not a traceback minutes into a measurement."""

    def parse(text: str) -> Any:
        with contextlib.suppress(ValueError):
            if ok(value := kind(text)):
                return value
        raise argparse.ArgumentTypeError(f"{text!r} is not {words}")

    return parse


COUNT = checked(int, lambda n: n >= 1, "a whole number >= 1")
SIZE = checked(float, lambda x: x > 0, "a number > 0")
HXL = r"[1-9]\d*x[1-9]\d*"  # a model's HIDDENxLAYERS
SHAPE = checked(str, re.compile(HXL).fullmatch, "HIDDENxLAYERS (e.g. 1024x8)")
SHAPES = checked(str, re.compile(rf"{HXL}(,{HXL})*").fullmatch, "HIDDENxLAYERS,... (256x4,512x8)")
FOLDER = checked(str, lambda p: os.path.isdir(p) and os.access(p, os.W_OK), "a writable folder")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def best_decile(values: list[float]) -> float:
    """The 90th percentile: on a shared machine, the steadier estimate of uncontended speed."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def median_seconds(fn: Callable[[], object], repeats: int, device: Any, before=None) -> float:
    """Median wall time of `fn` over `repeats` calls (after one untimed call); `before` runs
    untimed ahead of each call (e.g. restoring the gradients a clip scaled)."""
    from model_utils.report.metrics.device import device_sync

    sync, times = device_sync(device), []
    for index in range(repeats + 1):
        if before is not None:
            before()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if index:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def world_of_one(device: Any) -> None:
    """A process group of this one process (NCCL on CUDA, else gloo) unless one is running."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def build_model(args: Any, device: Any) -> tuple[Any, Any]:
    """train.py's model for the flags `args` (FSDP2 on a one-rank mesh) and its precision
    backend; the process group must be running (world_of_one)."""
    import torch.distributed as dist

    import train
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    world = distributed.world_from_env({})
    mesh = distributed.build_mesh(world, device, args.parallel.sharding_strategy)
    backend = precision.build_backend(args, device, dp_group=dist.group.WORLD)
    return train.build_model(args, mesh, device, backend), backend


def random_batch(args: Any, device: Any, generator: Any = None) -> Any:
    """One micro-batch of random token ids in the shape the flags `args` train on."""
    import torch

    shape = (args.data.train_batch_size, args.model.max_context_width)
    return torch.randint(0, args.model.vocab_size, shape, generator=generator).to(device)


def train_in_process(argv: list[str]) -> list[dict]:
    """train.main() on `argv` in this process, into a temporary folder: its metrics records."""
    import train
    from model_utils.report import metrics

    with tempfile.TemporaryDirectory(prefix="bench_") as out:
        train.main([*argv, "--output_dir", out])
        return metrics.read_jsonl(Path(out) / "metrics.jsonl")


def train_subprocess(flags: list[str], run_dir: Path, env: dict | None = None) -> list[dict]:
    """train.py in a fresh process (no checkpoints) into `run_dir`: its metrics records."""
    from model_utils.report import metrics

    argv = [sys.executable, str(ROOT / "train.py"), *flags, "--checkpoint_freq=-1"]
    argv.append(f"--output_dir={run_dir}")
    subprocess.run(argv, check=True, capture_output=True, cwd=ROOT, env=env)
    return metrics.read_jsonl(run_dir / "metrics.jsonl")
