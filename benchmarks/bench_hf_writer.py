"""The converter's safetensors writer against torch DCP's HuggingFaceStorageWriter, on one
checkpoint (issue 30: whether DCP's writer should replace the hand-written one).

    .venv/bin/python -m benchmarks.bench_hf_writer                       # 1024x8, ~0.5 GB fp32
    .venv/bin/python -m benchmarks.bench_hf_writer --shape 2048x8 --shard_mb 500 --repeats 3

Both read the same DCP checkpoint (saved by the training code's Checkpointer) in one process
without a process group and write fp32 safetensors shards of at most --shard_mb:
  ours  the converter's path: one decoder layer read at a time (iter_dcp_model_layers) into
        SafetensorsShardWriter (hidden parts, renamed to their HF names once all are written)
  dcp   HuggingFaceStorageWriter's path: dcp.save takes one state dict, so the whole model is
        read first, then saved with a fqn_to_index_mapping that packs the same shard size
Each write runs in a fresh process, so the peak memory it prints is its own (anonymous memory
above the process's start, sampled: AnonPeak); the two orders
alternate over the repeats (page cache). The outputs' tensors are compared with torch.equal.
Prints each writer's median seconds and peak memory, and the ratios dcp / ours.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from benchmarks._common import COUNT, FOLDER, SHAPE
from model_utils.errors import OneLineParser

WRITERS = ("ours", "dcp")


def make_checkpoint(root: Path, shape: str) -> Path:
    """A checkpoint of a Llama of `shape` (hidden x layers, the tiny preset's proportions)."""
    from transformers import LlamaForCausalLM

    from model_utils import checkpoint as ck
    from model_utils.config import arguments
    from model_utils.model import modeling

    hidden, layers = (int(x) for x in shape.split("x"))
    argv = ["--preset", "tiny", "--hidden_width", str(hidden), "--num_layers", str(layers)]
    argv += ["--intermediate_size", str(hidden * 8 // 3 // 64 * 64), "--num_heads", "8"]
    argv += ["--num_key_value_heads", "4"]
    model = LlamaForCausalLM(modeling.model_config(arguments.parse_args(argv).model))
    return ck.Checkpointer(root / "ckpt").save(1, ck.TrainState(model))


def write_ours(checkpoint: Path, out: Path, shard_bytes: int) -> None:
    from model_utils.checkpoint.hf import SafetensorsShardWriter
    from model_utils.checkpoint.layout import iter_dcp_model_layers

    writer = SafetensorsShardWriter(out, shard_bytes)
    for layer in iter_dcp_model_layers(checkpoint):
        for name, tensor in layer.items():
            writer.add(name, tensor)
    writer.finish()


def write_dcp(checkpoint: Path, out: Path, shard_bytes: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from model_utils.checkpoint.layout import MODEL_PREFIX, read_full_tensors, saved_tensors

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    full = read_full_tensors(checkpoint, saved_tensors(metadata, MODEL_PREFIX))
    mapping, index, used = {}, 1, 0
    for name, tensor in full.items():
        size = tensor.numel() * tensor.element_size()
        if used and used + size > shard_bytes:
            index, used = index + 1, 0
        mapping[name], used = index, used + size
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=mapping)
    dcp.save(full, storage_writer=writer, no_dist=True)


class AnonPeak:
    """The peak of this process's anonymous memory (RssAnon, sampled every 5 ms): the memory
    it holds. ru_maxrss would also count the checkpoint's pages that DCP's reader maps, which
    belong to the page cache and are the same for both writers."""

    def __init__(self) -> None:
        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_kb = max(self.peak_kb, anon_kb())

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, anon_kb())


def anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(writer: str, checkpoint: Path, out: Path, shard_bytes: int) -> None:
    """One write in this process: prints {seconds, peak_mb} as JSON (imports not timed)."""
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401

    import model_utils.checkpoint  # noqa: F401

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    before = anon_kb()
    with AnonPeak() as peak:
        start = time.perf_counter()
        (write_ours if writer == "ours" else write_dcp)(checkpoint, out, shard_bytes)
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mb": (peak.peak_kb - before) / 1024}))


def run_child(writer: str, checkpoint: Path, out: Path, shard_bytes: int) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, __file__, "--child", writer, "--checkpoint", str(checkpoint)]
    argv += ["--out", str(out), "--shard_bytes", str(shard_bytes)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def compare(root: Path, checkpoint: Path, shard_bytes: int, repeats: int) -> None:
    results: dict[str, list[dict[str, float]]] = {w: [] for w in WRITERS}
    for i in range(repeats):
        for writer in WRITERS if i % 2 == 0 else WRITERS[::-1]:
            results[writer].append(run_child(writer, checkpoint, root / writer, shard_bytes))
    ours, theirs = tensors(root / "ours"), tensors(root / "dcp")
    exact = set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    files = {w: len(list((root / w).glob("*.safetensors"))) for w in WRITERS}
    median = {
        w: {k: statistics.median(r[k] for r in results[w]) for k in ("seconds", "peak_mb")}
        for w in WRITERS
    }
    size_mb = sum(t.numel() * t.element_size() for t in ours.values()) / 2**20
    print(f"model {size_mb:.0f} MB fp32, shards <= {shard_bytes / 2**20:.0f} MB, {repeats} runs")
    for w in WRITERS:
        m = median[w]
        print(
            f"  {w:5} {m['seconds']:7.2f} s  peak memory {m['peak_mb']:7.0f} MB  {files[w]} files"
        )
    ratio_s = median["dcp"]["seconds"] / median["ours"]["seconds"]
    ratio_mb = median["dcp"]["peak_mb"] / median["ours"]["peak_mb"]
    print(f"dcp / ours: time {ratio_s:.2f}x, peak memory {ratio_mb:.2f}x; same tensors: {exact}")


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1024x8", type=SHAPE, help="hidden x layers")
    p.add_argument("--shard_mb", type=COUNT, default=200, help="safetensors shard size")
    p.add_argument("--repeats", type=COUNT, default=3)
    p.add_argument("--dir", type=FOLDER, help="where to write (default: a temp dir, removed)")
    p.add_argument("--child", choices=WRITERS, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--shard_bytes", type=int, help=argparse.SUPPRESS)
    cli = p.parse_args()
    if cli.child:
        child(cli.child, Path(cli.checkpoint), Path(cli.out), cli.shard_bytes)
        return
    root = Path(cli.dir or tempfile.mkdtemp(prefix="bench_hf_writer_"))
    try:
        checkpoint = make_checkpoint(root, cli.shape)
        compare(root, checkpoint, cli.shard_mb * 2**20, cli.repeats)
    finally:
        if cli.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
