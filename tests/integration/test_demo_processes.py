"""`make demo`'s script end to end, as on a CPU without bf16 units (--compute fp32, what auto
picks there): two real train.py runs, FP8 emulated around fp32, the table and the picture
labelled with what ran. Two steps of small windows: the demo's path, not its curve."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.procs import PYTHON
from helpers.runs import train_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_on_a_cpu_without_bf16_units_computes_in_fp32_and_labels_it(tmp_path):
    out = tmp_path / "demo"
    argv = ["-m", "scripts.demo", "--steps=2", f"--out={out}", "--compute=fp32"]
    argv += ["--train_batch_size=2", "--max_context_width=64", "--validation_batches=1"]
    done = subprocess.run(
        [PYTHON, *argv], capture_output=True, text=True, timeout=900, env=train_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("make demo: this CPU has no bf16 units")
    assert sorted(p.name for p in out.iterdir()) == ["compare.png", "fp32", "fp8"]
    assert "fp8 (emulated in fp32)" in done.stdout and "--bf16=0" in done.stdout
    assert "emulated in fp32 (numerics only" in done.stdout + done.stderr  # the FP8 run's line
    assert (out / "compare.png").stat().st_size > 10_000
    assert any(line.startswith("make demo: both runs took ") for line in lines)
