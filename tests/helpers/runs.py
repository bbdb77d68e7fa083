"""train.py's arguments the tests share (the tiny preset cut to milliseconds per step), the
data section a data stage is handed and the documents its stream reads, and train.py in a
subprocess: its command, its environment, what its metrics.jsonl recorded."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

from helpers.procs import PYTHON, launch_report, torchrun_cmd, warm_env
from model_utils.config.presets import BUNDLED_TOKENIZER, PRESETS
from model_utils.config.sections import DataConfig
from model_utils.data.stream import BLOCK_DOCS, _BlockReader

ROOT = Path(__file__).resolve().parents[2]


# The tiny preset cut to milliseconds per step (GQA, 2 layers; every linear FP8-sized): the shape
# the in-process checkpoint and cross-implementation tests and their processes share.
SMALL_LLAMA = (
    "--preset tiny --hidden_width 64 --num_layers 2 --num_heads 4 --num_key_value_heads 2 "
    "--intermediate_size 128 --max_context_width 32"
).split()


# The tiny preset at half its width, on small windows: a step costs about a third of one at the
# preset's width on 128-token windows (0.09 against 0.25 CPU s here), and every linear stays
# FP8-sized (multiples of 16). fp32 compute: a CPU without bf16 units (AVX2 only, like CI's)
# runs bf16 matmuls 20-60x slower than fp32 ones; the tests whose point is bf16 or FP8 say
# --bf16=1 after FAST.
FAST = [
    *("--preset", "tiny", "--hidden_width", "128", "--intermediate_size", "352"),
    *("--train_batch_size", "4", "--max_context_width", "64", "--bf16=0"),
]
#: The tiny preset's own width, after FAST, for the tests whose numbers are the preset's: how
#: far it learns in a few steps, how large its checkpoint is.
TINY_WIDTH = [
    f"--{name}={getattr(PRESETS['tiny'], name)}" for name in ("hidden_width", "intermediate_size")
]


def data_section(dataset: str, **fields) -> DataConfig:
    """The data section a stage is handed (TrainStream, validation_batches, epoch_documents):
    this dataset, its text column "text", batches of one unless a field says otherwise."""
    defaults = {
        "tokenizer": BUNDLED_TOKENIZER,
        "dataset": dataset,
        "dataset_config_name": None,
        "text_column": "text",
        "train_batch_size": 1,
        "val_batch_size": 1,
        "verify_data": "sampled",
    }
    return DataConfig(**{**defaults, **fields})


def epoch_documents(
    source: DataConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
    block_docs: int = BLOCK_DOCS,
) -> Iterator[str]:
    """The training documents a TrainStream with these settings packs in `epoch`, in order
    (its block reader's, read through): what the tests hold the stream's order against."""
    reader = _BlockReader(source, rank, world_size, seed, block_docs)
    reader.open(epoch)
    block = 0
    while texts := reader.read_block(block):
        yield from texts
        block += 1


def train_cmd(*argv: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [PYTHON, str(ROOT / "train.py"), *argv]
    return torchrun_cmd(str(ROOT / "train.py"), *argv, nproc=nproc)


def train_env() -> dict[str, str]:
    """Thread count is part of the numerics (reduction order): runs that are compared bit for
    bit must use the same one, whatever the caller's environment says (one: the suite's count,
    tests/conftest.py TEST_THREADS)."""
    return {**warm_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_train(*argv: str, nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(
        train_cmd(*argv, nproc=nproc),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=train_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, launch_report(result)
    return result


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}
