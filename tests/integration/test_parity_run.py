"""benchmarks/gpu_parity.sh --dry_run: the GPU loss A/B's own script on a CPU (the launcher, one
torchrun worker a run as on the one-GPU machine, the tiny recipes): the emulated FP8 twin matches
its BF16 twin, and the same FP8 run with a planted scale error (tests/helpers/damaged_fp8; train.py
started directly, a world of one like the launcher's) drifts, its underflow named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import warm_env

ROOT = Path(__file__).resolve().parents[2]
#: What the dry run gives its FP8 twin, for the damaged run to repeat (fp32 twins: --bf16=0).
TINY = "--max_context_width 64 --train_batch_size 2 --bf16=0 --max_steps 20 --warmup 2"
TINY += " --validation_freq 10"
SCHEDULE = [*TINY.split(), "--validation_batches", "4", "--logging_freq", "1"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("parity")
    env = {**warm_env(), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_parity.sh", str(out), "--dry_run", "--", "--fp8_numerics"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_the_dry_run_pair_matches_and_records_its_numerics(dry_run) -> None:
    out, stdout = dry_run
    verdict = (out / "verdict.txt").read_text()
    assert "verdict: fp8 tensorwise hf matches fp32 hf over steps 2-20" in verdict
    gaps = re.search(r"train loss gap: mean ([-+.\d]+)%, largest ([-+.\d]+)%", verdict)
    assert gaps and abs(float(gaps[2])) < 1.0
    assert "FP8 numerics of fp8 tensorwise hf at step 20 (28 linears):" in verdict
    assert (out / "compare.png").stat().st_size > 10_000
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["bf16", "fp8"]
    assert (
        "FP8 numerics at step 20 (28 linears): worst underflow" in (out / "parity.log").read_text()
    )
    assert stdout == (out / "parity.log").read_text()  # everything printed is kept


def test_a_damaged_fp8_run_drifts_and_its_numerics_say_why(dry_run, tmp_path) -> None:
    out, _ = dry_run
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "helpers" / "damaged_fp8"), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
    }
    flags = [
        "--recipe",
        "tiny-fp8",
        *SCHEDULE,
        "--fp8_numerics",
        f"--output_dir={tmp_path}/damaged",
    ]
    launch = [sys.executable, "train.py", *flags]
    done = subprocess.run(launch, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compare = [
        sys.executable,
        "-m",
        "analysis.compare_runs",
        str(out / "bf16"),
        str(tmp_path / "damaged"),
    ]
    done = subprocess.run(
        [*compare, "--output", str(tmp_path / "c.png")], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"verdict: fp8 tensorwise hf drifts from fp32 hf over steps 2-20: the train loss gap "
        r"left the ±1% band at step \d+",
        done.stdout,
    ), done.stdout
    underflow = re.search(r"worst underflow: \S+ (input|weight|grad) ([\d.]+)%", done.stdout)
    assert underflow and float(underflow[2]) > 50, done.stdout
