"""analysis/compare_runs.py on a real train.py run: its log and its run directory read the same."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.procs import PYTHON

from analysis import compare_runs as cr

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------- a real run, both ways


def test_a_real_run_reads_the_same_from_its_log_and_its_directory(tmp_path: Path) -> None:
    """train.py's stdout (what slurm-<job>.out holds) and its run directory give the same
    records, to the log's printed precision, the same flags, and the same table."""
    out = tmp_path / "run"
    cmd = [
        PYTHON,
        str(ROOT / "train.py"),
        "--preset",
        "tiny",
        "--train_batch_size",
        "2",
        "--max_context_width",
        "64",
        "--max_steps=8",
        "--bf16=0",  # fp32 compute: bf16 matmuls are 20-60x slower on a CPU without bf16 units
        "--warmup=2",
        "--logging_freq=2",
        "--validation_freq=4",
        "--validation_batches=1",
        f"--output_dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = tmp_path / "slurm-7.out"
    log.write_text(done.stdout)

    from_log, from_dir = cr.load_run(log), cr.load_run(out)
    assert from_log.info == from_dir.info and from_log.info["flags"]["max_steps"] == 8
    assert [(r["kind"], r["step"]) for r in from_log.records] == [
        (r["kind"], r["step"]) for r in from_dir.records
    ]
    precision = {
        "loss": 1e-5,
        "val_loss": 1e-5,
        "samples_per_sec": 1e-2,
        "lr": 1e-6,
        "tflops_per_device": 1e-3,
        "peak_mem_gib": 1e-2,
        "data_wait_pct": 0.1,
        "tokens_per_sec_per_device": 1.0,
    }
    for a, b in zip(from_log.records, from_dir.records, strict=True):
        for key in set(a) - {"kind", "step"}:
            assert a[key] == pytest.approx(b[key], abs=precision[key]), key

    done = subprocess.run(
        [
            PYTHON,
            str(ROOT / "analysis" / "compare_runs.py"),
            str(log),
            str(out),
            "--output",
            str(tmp_path / "cmp.png"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"final train loss\s+(\S+)\s+\1\s+1\.000", done.stdout), done.stdout
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
