"""Data pipeline throughput on the bundled corpus: model_utils.data vs the upstream recipe's style.

    .venv/bin/python benchmarks/bench_data.py                     # tiny preset shape: 8 x 256
    .venv/bin/python benchmarks/bench_data.py --seq_len 4096 --micro_batch 1

Pipelines, each fed the same corpus file through `datasets` streaming and a freshly loaded copy
of the bundled tokenizer (so no run profits from another's BPE cache):
  ours         model_utils.data.TrainStream (batched Rust tokenisation, numpy packing)
  per-example  the upstream recipe's way: a torch IterableDataset calling the tokenizer once per
               document and growing a Python list buffer, batched by a DataLoader
  map+group    the transformers run_clm way: IterableDataset.map(tokenize, batched) then
               .map(group_texts, batched), batched by a DataLoader
Repeats are interleaved and the median is reported, because other processes share the cores.
Also measured: the cost of resuming at 80% of an epoch (ours: restore the saved position;
upstream: re-read and re-tokenise every skipped batch, as the recipe did).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data import IterableDataset as TorchIterable  # noqa: E402

from model_utils import data  # noqa: E402

Batches = Iterator[dict[str, torch.Tensor]]


def _hf_stream(seed: int):
    from datasets import load_dataset

    ds = load_dataset("json", data_files=data.DEFAULT_DATASET, split="train", streaming=True)
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
    tokenizer = data.load_tokenizer(data.DEFAULT_TOKENIZER)
    windows = PerExampleConcat(_hf_stream(seed=42), tokenizer, seq_len)
    for input_ids in DataLoader(windows, batch_size=micro_batch, num_workers=0):
        yield {"input_ids": input_ids, "labels": input_ids.clone()}


def map_group(seq_len: int, micro_batch: int) -> Batches:
    tokenizer = data.load_tokenizer(data.DEFAULT_TOKENIZER)
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


def ours(seq_len: int, micro_batch: int) -> Batches:
    tokenizer = data.load_tokenizer(data.DEFAULT_TOKENIZER)
    yield from data.TrainStream(data.DEFAULT_DATASET, tokenizer, seq_len, micro_batch, seed=42)


PIPELINES: dict[str, Callable[[int, int], Batches]] = {
    "ours": ours,
    "per-example": per_example,
    "map+group": map_group,
}


def measure(
    make: Callable[[int, int], Batches], seq_len: int, micro_batch: int, tokens: int
) -> tuple[float, float, float]:
    """Seconds to the first batch, then tokens per second and per CPU-second (all threads of
    this process) over the next `tokens` tokens."""
    start = time.perf_counter()
    batches = make(seq_len, micro_batch)
    first = next(batches)
    assert first["input_ids"].shape == (micro_batch, seq_len)
    startup = time.perf_counter() - start
    produced, wall, cpu = 0, time.perf_counter(), time.process_time()
    while produced < tokens:
        produced += next(batches)["input_ids"].numel()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return startup, produced / wall, produced / cpu


def resume_cost(seq_len: int, micro_batch: int, skip: int) -> tuple[float, float]:
    """Seconds to the batch after `skip` batches: restoring our state vs replaying upstream."""
    tokenizer = data.load_tokenizer(data.DEFAULT_TOKENIZER)
    stream = data.TrainStream(data.DEFAULT_DATASET, tokenizer, seq_len, micro_batch, seed=42)
    for _ in range(skip):
        next(stream)
    state = stream.state_dict()
    start = time.perf_counter()
    resumed = data.TrainStream(data.DEFAULT_DATASET, tokenizer, seq_len, micro_batch, seed=42)
    resumed.load_state_dict(state)
    next(resumed)
    restore = time.perf_counter() - start
    start = time.perf_counter()
    replay = per_example(seq_len, micro_batch)
    for _ in range(skip + 1):
        next(replay)
    return restore, time.perf_counter() - start


def _warm_up_imports() -> None:
    """Import and touch the libraries once so that no pipeline's timing pays for it."""
    import datasets  # noqa: F401

    tokenizer = data.load_tokenizer(data.DEFAULT_TOKENIZER)
    data.encode_documents(tokenizer, ["warm up"])
    next(iter(_hf_stream(seed=0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=600_000, help="tokens timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(PIPELINES), help="time one pipeline (no ratios)")
    parser.add_argument("--skip_extras", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = f"micro_batch {args.micro_batch} x seq_len {args.seq_len}"
    names = [args.only] if args.only else list(PIPELINES)
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"corpus {Path(data.DEFAULT_DATASET).name}, {shape}, {args.tokens:,} tokens per run")
    _warm_up_imports()
    startup: dict[str, list[float]] = {n: [] for n in names}
    rate: dict[str, list[float]] = {n: [] for n in names}
    cpu_rate: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            seconds, per_s, per_cpu_s = measure(
                PIPELINES[name], args.seq_len, args.micro_batch, args.tokens
            )
            startup[name].append(seconds)
            rate[name].append(per_s)
            cpu_rate[name].append(per_cpu_s)
    print(
        f"{'pipeline':12s} {'tokens/s':>9s} {'per CPU-s':>10s} {'1st batch':>10s}  runs (tokens/s)"
    )
    for name in names:
        runs = ", ".join(f"{r / 1e3:.0f}k" for r in rate[name])
        print(
            f"{name:12s} {statistics.median(rate[name]) / 1e3:8.0f}k "
            f"{statistics.median(cpu_rate[name]) / 1e3:9.0f}k "
            f"{statistics.median(startup[name]):9.2f}s  {runs}"
        )
    if args.only or args.skip_extras:
        return
    mine = statistics.median(rate["ours"])
    mine_cpu = statistics.median(cpu_rate["ours"])
    for name in names[1:]:
        print(
            f"ratio ours / {name}: {mine / statistics.median(rate[name]):.1f}x tokens/s, "
            f"{mine_cpu / statistics.median(cpu_rate[name]):.1f}x tokens per CPU-second"
        )
    per_step_ms = args.micro_batch * args.seq_len / mine * 1e3
    print(f"data time per micro-batch (ours): {per_step_ms:.1f} ms")

    # Our tokenizer calls use the Rust thread pool; show what one thread does, in a fresh process
    # (the pool is sized once per process).
    child = subprocess.run(
        [sys.executable, __file__, "--only", "ours", "--repeats", str(args.repeats)]
        + ["--seq_len", str(args.seq_len), "--micro_batch", str(args.micro_batch)]
        + ["--tokens", str(args.tokens)],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        check=True,
    )
    single = child.stdout.strip().splitlines()[-1].split()[1]
    print(f"ours with TOKENIZERS_PARALLELISM=false (one tokenizer thread): {single} tokens/s")
    if os.environ.get("TOKENIZERS_PARALLELISM") == "false":
        print("(this whole run had TOKENIZERS_PARALLELISM=false)")

    skip = int(0.8 * 900_000 / (args.micro_batch * args.seq_len))
    restore, replay = resume_cost(args.seq_len, args.micro_batch, skip)
    print(
        f"resume at batch {skip}: ours {restore:.2f} s (restore state), "
        f"upstream style {replay:.2f} s (re-read + re-tokenise), {replay / restore:.0f}x"
    )


if __name__ == "__main__":
    main()
