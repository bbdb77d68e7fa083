"""scripts/stage_data.py: stage tokenizer + dataset, then train with the Hub switched off."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from scripts import stage_data

ROOT = Path(__file__).resolve().parents[2]


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def make_source(tmp_path: Path) -> Path:
    """A small dataset of the kind the Hub streams: train file plus a validation file."""
    folder = tmp_path / "source"
    folder.mkdir()
    corpus = [json.loads(line) for line in gzip.open(ROOT / "data" / "kjv.jsonl.gz", "rt")]
    texts = [row["text"] for row in corpus]
    for name, rows in (("train.jsonl", texts[:600]), ("validation.jsonl", texts[600:700])):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return folder


def read_staged(folder: Path, pattern: str) -> list[str]:
    texts = []
    for file in sorted(folder.glob(pattern)):
        texts += [json.loads(line)["text"] for line in gzip.open(file, "rt")]
    return texts


def test_staged_data_trains_offline(tmp_path: Path) -> None:
    source = make_source(tmp_path)
    out = tmp_path / "stage"
    argv = [
        "--out",
        str(out),
        "--dataset",
        str(source),
        "--documents",
        "500",
        "--shards",
        "4",
        "--tokenizer",
        str(ROOT / "data" / "tokenizer"),
    ]
    assert stage_data.main(argv) == 0
    staged = out / "source"
    train_files = sorted(staged.glob("train-*.jsonl.gz"))
    assert [f.name for f in train_files] == [f"train-{i:05d}-of-00004.jsonl.gz" for i in range(4)]
    source_texts = [json.loads(line)["text"] for line in open(source / "train.jsonl")]
    assert read_staged(staged, "train-*") == source_texts[:500]  # stream order, nothing lost
    # the whole validation split (1% of --documents, 5, left too few for the source's batches)
    validation = [json.loads(line)["text"] for line in open(source / "validation.jsonl")]
    assert read_staged(staged, "validation-*") == validation and len(validation) == 100
    assert not list(out.rglob("*.partial"))
    tokenizer = out / "tokenizers" / "tokenizer"
    assert (tokenizer / "tokenizer.json").exists()

    run = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--preset",
            "tiny",
            "--max_steps",
            "3",
            "--warmup",
            "1",
            "--train_batch_size",
            "2",
            "--max_context_width",
            "128",
            "--validation_batches",
            "1",
            "--checkpoint_freq",
            "-1",
            "--bf16=0",  # fp32 compute: bf16 matmuls are 20-60x slower on this CPU
            f"--tokenizer={tokenizer}",
            f"--dataset={staged}",
            f"--output_dir={run}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "val" for r in records)  # the staged validation file is read
    assert "Batch 3 Loss" in result.stdout + result.stderr

    # Staging again into the same place would mix two stagings: refused in one line.
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stage_data.py"), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert again.returncode == 2
    assert (
        again.stderr.strip().count("\n") == 0 and "already holds a staged dataset" in again.stderr
    )
