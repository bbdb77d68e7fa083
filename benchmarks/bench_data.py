"""Data pipeline throughput on the bundled corpus: model_utils.data vs the upstream recipe's style.

    .venv/bin/python -m benchmarks.bench_data                     # tiny preset shape: 8 x 256
    .venv/bin/python -m benchmarks.bench_data --seq_len 4096 --micro_batch 1

Pipelines, each fed the same corpus file through `datasets` streaming and a freshly loaded copy
of the bundled tokenizer (so no run profits from another's BPE cache):
  ours         model_utils.data.stream.TrainStream (batched Rust tokenisation, numpy packing)
  per-example  the upstream recipe's way: a torch IterableDataset calling the tokenizer once per
               document and growing a Python list buffer, batched by a DataLoader
  map+group    the transformers run_clm way: IterableDataset.map(tokenize, batched) then
               .map(group_texts, batched), batched by a DataLoader
Rates are end to end (construction to --tokens tokens). Repeats are interleaved and the median
and best are reported, because other processes may share the cores; tokens per CPU-second
(all threads) is the load-robust efficiency figure, and `ours-1thread` (TOKENIZERS_PARALLELISM=
false, own process) separates batching gains from the Rust thread pool's parallelism.
Also measured: the cost of resuming at 80% of an epoch (ours: restore the saved position;
upstream: re-read and re-tokenise every skipped batch, as the recipe did).

    .venv/bin/python -m benchmarks.bench_data --step_ms 150 --seq_len 8192 --micro_batch 4

measures instead what a training step waits for its batch when the step itself takes
--step_ms (the host idle, as while a GPU step runs): ours with the next tokenizer batch encoded
ahead on a thread, and without (``prefetch=False``), interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterable

from benchmarks._common import COUNT, SIZE
from model_utils import data
from model_utils.config.presets import BUNDLED_DATASET, BUNDLED_TOKENIZER
from model_utils.config.sections import DataConfig
from model_utils.data.stream import TrainStream
from model_utils.data.tokens import encode_documents
from model_utils.errors import OneLineParser

Batches = Iterator[dict[str, torch.Tensor]]


def _hf_stream(seed: int):
    from datasets import load_dataset

    ds = load_dataset("json", data_files=BUNDLED_DATASET, split="train", streaming=True)
    return ds.shuffle(seed=seed)  # as the upstream recipe: shuffle buffer of 1000 documents


class PerExampleConcat(TorchIterable):
    """Upstream style: tokenise one document at a time, concatenate Python lists, cut windows."""

    def __init__(self, documents, tokenizer, seq_len: int) -> None:
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len

    def __iter__(self) -> Iterator[np.ndarray]:
        buffer: list[int] = []
        for example in self.documents:
            encoded = self.tokenizer(example["text"], truncation=False, padding=False)
            buffer = buffer + encoded["input_ids"] + [self.tokenizer.eos_token_id]
            while len(buffer) >= self.seq_len:
                window, buffer = buffer[: self.seq_len], buffer[self.seq_len :]
                yield np.array(window)


def per_example(seq_len: int, micro_batch: int) -> Batches:
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    windows = PerExampleConcat(_hf_stream(seed=42), tokenizer, seq_len)
    for input_ids in DataLoader(windows, batch_size=micro_batch, num_workers=0):
        yield {"input_ids": input_ids, "labels": input_ids.clone()}


def map_group(seq_len: int, micro_batch: int) -> Batches:
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch["text"], return_attention_mask=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def group(batch: dict) -> dict:
        flat = [t for ids in batch["input_ids"] for t in ids]
        usable = len(flat) // seq_len * seq_len  # the remainder of every map batch is dropped
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, usable, seq_len)]}

    columns = ["text", "book", "chapter"]
    stream = _hf_stream(seed=42).map(tokenize, batched=True, remove_columns=columns)
    stream = stream.map(group, batched=True).with_format("torch")
    for batch in DataLoader(stream, batch_size=micro_batch, num_workers=0):
        yield {"input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}


def _source(micro_batch: int) -> DataConfig:
    """The data section of the bundled corpus, as train.py hands it to the stream."""
    return DataConfig(
        BUNDLED_TOKENIZER, BUNDLED_DATASET, None, "text", micro_batch, micro_batch, "sampled"
    )


def ours(seq_len: int, micro_batch: int) -> Batches:
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    yield from TrainStream(_source(micro_batch), tokenizer, seq_len, seed=42)


PIPELINES: dict[str, Callable[[int, int], Batches]] = {
    "ours": ours,
    "per-example": per_example,
    "map+group": map_group,
}


def measure(
    make: Callable[[int, int], Batches], seq_len: int, micro_batch: int, tokens: int
) -> tuple[float, float, float]:
    """Seconds to the first batch; tokens per second and per CPU-second (all threads of this
    process) from construction until `tokens` tokens have been yielded: end to end, because
    pipelines differ in how much work they do before their first batch."""
    wall, cpu = time.perf_counter(), time.process_time()
    batches = make(seq_len, micro_batch)
    first = next(batches)
    assert first["input_ids"].shape == (micro_batch, seq_len)
    startup = time.perf_counter() - wall
    produced = first["input_ids"].numel()
    while produced < tokens:
        produced += next(batches)["input_ids"].numel()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return startup, produced / wall, produced / cpu


def resume_cost(seq_len: int, micro_batch: int, skip: int) -> tuple[float, float]:
    """Seconds to the batch after `skip` batches: restoring our state vs replaying upstream."""
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    stream = TrainStream(_source(micro_batch), tokenizer, seq_len, seed=42)
    for _ in range(skip):
        next(stream)
    state = stream.state_dict()
    start = time.perf_counter()
    resumed = TrainStream(_source(micro_batch), tokenizer, seq_len, seed=42)
    resumed.load_state_dict(state)
    next(resumed)
    restore = time.perf_counter() - start
    start = time.perf_counter()
    replay = per_example(seq_len, micro_batch)
    for _ in range(skip + 1):
        next(replay)
    return restore, time.perf_counter() - start


def stalls(seq_len: int, micro_batch: int, step_ms: float, steps: int, prefetch: bool):
    """Each of `steps` batches' wait, in ms, when every step spends `step_ms` after its batch."""
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    stream = TrainStream(_source(micro_batch), tokenizer, seq_len, seed=42, prefetch=prefetch)
    next(stream)  # the first read and batch are the same either way
    waits = []
    for _ in range(steps):
        start = time.perf_counter()
        next(stream)
        waits.append((time.perf_counter() - start) * 1e3)
        time.sleep(step_ms / 1e3)
    return waits


def stall_report(args: argparse.Namespace) -> None:
    runs: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for prefetch in runs:
            runs[prefetch].append(
                stalls(args.seq_len, args.micro_batch, args.step_ms, args.steps, prefetch)
            )
    for prefetch, waits in runs.items():
        totals = [sum(w) for w in waits]
        print(
            f"prefetch {str(prefetch):5s}: waited {statistics.median(totals):7.1f} ms in "
            f"{args.steps} steps (median of runs), longest wait "
            f"{statistics.median(max(w) for w in waits):6.1f} ms"
        )
    no, yes = (statistics.median(sum(w) for w in runs[p]) for p in (False, True))
    print(f"waiting without / with prefetch: {no / yes:.1f}x")


def _warm_up_imports() -> None:
    """Import and touch the libraries once so that no pipeline's timing pays for it."""
    import datasets  # noqa: F401

    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    encode_documents(tokenizer, ["warm up"])
    next(iter(_hf_stream(seed=0)))


@dataclass
class Runs:
    """Per-run measurements of one pipeline."""

    startup: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    cpu_rate: list[float] = field(default_factory=list)

    def row(self, name: str) -> str:
        runs = ", ".join(f"{r / 1e3:.0f}k" for r in self.rate)
        return (
            f"{name:12s} {statistics.median(self.rate) / 1e3:8.0f}k {max(self.rate) / 1e3:6.0f}k "
            f"{statistics.median(self.cpu_rate) / 1e3:9.0f}k "
            f"{statistics.median(self.startup):9.2f}s  {runs}"
        )


HEADER = (
    f"{'pipeline':12s} {'tokens/s':>9s} {'best':>7s} {'per CPU-s':>10s} {'1st batch':>10s}  runs"
)


def run_all(names: list[str], args: argparse.Namespace) -> dict[str, Runs]:
    """Interleaved repeats, so that load from other processes hits every pipeline alike."""
    _warm_up_imports()
    results = {name: Runs() for name in names}
    for _ in range(args.repeats):
        for name in names:
            startup, rate, cpu_rate = measure(
                PIPELINES[name], args.seq_len, args.micro_batch, args.tokens
            )
            results[name].startup.append(startup)
            results[name].rate.append(rate)
            results[name].cpu_rate.append(cpu_rate)
    return results


def one_thread_row(args: argparse.Namespace) -> str:
    """Our pipeline with a single tokenizer thread: a fresh process, because the Rust thread pool
    is sized once per process."""
    same = ("repeats", "seq_len", "micro_batch", "tokens")  # this run's, passed on
    command = [sys.executable, __file__, "--only", "ours", "--label", "ours-1thread"]
    command += [f"--{name}={getattr(args, name)}" for name in same]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=COUNT, default=256)
    parser.add_argument("--micro_batch", type=COUNT, default=8)
    parser.add_argument("--tokens", type=COUNT, default=800_000, help="tokens per run")
    parser.add_argument("--repeats", type=COUNT, default=3)
    parser.add_argument("--only", choices=sorted(PIPELINES), help="time one pipeline (no ratios)")
    parser.add_argument("--label", help=argparse.SUPPRESS)  # row name for --only
    parser.add_argument("--step_ms", type=SIZE, help="measure the step's wait instead")
    parser.add_argument("--steps", type=COUNT, default=60, help="steps per --step_ms run")
    args = parser.parse_args()
    names = [args.only] if args.only else list(PIPELINES)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"corpus {Path(BUNDLED_DATASET).name}, micro_batch {args.micro_batch} x seq_len "
        f"{args.seq_len}, {args.tokens:,} tokens per run, {args.repeats} interleaved runs; "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    if args.step_ms is not None:
        _warm_up_imports()
        stall_report(args)
        return
    results = run_all(names, args)
    print(HEADER)
    for name in names:
        print(results[name].row(args.label or name))
    if args.only:
        return
    print(one_thread_row(args))
    ours = results["ours"]
    median = statistics.median
    for name in names[1:]:
        other = results[name]
        print(
            f"ours / {name}: {median(ours.rate) / median(other.rate):.1f}x tokens/s (median), "
            f"{max(ours.rate) / max(other.rate):.1f}x (best), "
            f"{median(ours.cpu_rate) / median(other.cpu_rate):.1f}x tokens per CPU-second"
        )
    per_batch_ms = args.micro_batch * args.seq_len / statistics.median(ours.rate) * 1e3
    print(f"data time per micro-batch (ours, median): {per_batch_ms:.1f} ms")
    skip = int(0.8 * 900_000 / (args.micro_batch * args.seq_len))
    restore, replay = resume_cost(args.seq_len, args.micro_batch, skip)
    print(
        f"resume at batch {skip}: ours {restore:.2f} s (restore state), "
        f"upstream style {replay:.2f} s (re-read + re-tokenise), {replay / restore:.0f}x"
    )


if __name__ == "__main__":
    main()
