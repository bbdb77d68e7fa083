"""benchmarks/gpu_parity.sh and gpu_long_ab.sh --dry_run: the GPU loss A/Bs' own scripts on a
CPU (the launcher, one torchrun worker a run as on the one-GPU machine, the tiny recipes): the
emulated FP8 twin matches
its BF16 twin, and the same FP8 run with a planted scale error (tests/helpers/damaged_fp8; train.py
started directly, a world of one like the launcher's) is behind, its underflow named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import PYTHON, warm_venv

ROOT = Path(__file__).resolve().parents[2]
#: What the dry run gives its FP8 twin, for the damaged run to repeat (fp32 twins: --bf16=0).
TINY = "--max_context_width 64 --train_batch_size 2 --bf16=0 --max_steps 20 --warmup 2"
TINY += " --validation_freq 10"
SCHEDULE = [*TINY.split(), "--validation_batches", "4", "--logging_freq", "1"]


def script_env(venv: Path) -> dict[str, str]:
    """A GPU script's environment with every Python process of it warm: its analysis (PYTHON),
    the launcher's check, torchrun and its workers (warm_venv, in VENV); the script and the
    launcher run as a user's do."""
    return {**os.environ, **warm_venv(venv), "PYTHON": PYTHON, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("parity")
    done = subprocess.run(
        ["bash", "benchmarks/gpu_parity.sh", str(out), "--dry_run", "--", "--fp8_numerics"],
        capture_output=True,
        text=True,
        env=script_env(out.parent / "venv"),
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


def test_a_damaged_fp8_run_is_behind_and_its_numerics_say_why(dry_run, tmp_path) -> None:
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
        PYTHON,
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
        r"verdict: fp8 tensorwise hf is behind fp32 hf over steps 2-20: (by \d+ steps \(\d+%\) "
        r"at step \d+, )?the validation loss gap \+[\d.]+% at step 20 is outside ±1\.00% "
        r"\(first outside at step \d+\)",
        done.stdout,
    ), done.stdout
    underflow = re.search(r"worst underflow: \S+ (input|weight|grad) ([\d.]+)%", done.stdout)
    assert underflow and float(underflow[2]) > 50, done.stdout


#: One validation's step lag as the verdict prints it: "8 +0 (+1%)" or "12 >0 (not reached)".
LAG = re.compile(r"(\d+) (?:[+-]\d+ \([+-]\d+%\)|>\d+ \(not reached\))")


def long_ab(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/gpu_long_ab.sh", str(out), "--dry_run", *flags],
        capture_output=True,
        text=True,
        env=script_env(out.parent / "venv"),
        cwd=ROOT,
        timeout=900,
    )


def test_the_long_ab_fills_one_folder_in_two_calls_and_judges_every_arm_in_seed_noise(
    tmp_path,
) -> None:
    """benchmarks/gpu_long_ab.sh --dry_run, split as on the GPU: the BF16 reference, its seed
    replica and the shipped FP8 recipe, then the other two FP8 arms into the same folder, the
    arms of a call training at once; each call judges every arm present against bf16-a inside
    the band bf16-b spans."""
    out = tmp_path / "long"
    assert long_ab(out, "--arms", "bf16-a,nonsense").returncode == 2
    assert not out.joinpath("bf16-a").exists()  # every name checked before any run
    first = long_ab(out, "--arms", "bf16-a,bf16-b,fp8")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (out / "verdict.txt").read_text().count("verdict:") == 1
    assert (out / "verdict.txt").read_text().startswith("(the arms of a call trained at once:")
    second = long_ab(out, "--arms", "fp8-current,fp8-closer")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    verdict = (out / "verdict.txt").read_text()
    for arm in ("fp8", "fp8-current", "fp8-closer"):
        assert f"Parity of {arm} with bf16-a, steps 2-12 " in verdict
        assert f"verdict: {arm} is within seed noise of bf16-a over steps 2-12" in verdict
    assert verdict.count("seed noise of 1 replica(s) x2") == 3
    # Each arm's lag at bf16-a's validations (4, 8, 12), the last always: an earlier one is left
    # out where the arm's first validation already ties or beats it, which float rounding decides
    # on some CPUs (fp8-closer at step 4 on an AMD EPYC).
    lag_lines = re.findall(r"step lag at bf16-a's validations: (.*)", verdict)
    assert len(lag_lines) == 3, verdict
    for line in lag_lines:
        lags, band = line.split("; the band there ")  # in bf16-a's own steps, at its last lag
        assert band.endswith(" before step 12"), line
        found = list(LAG.finditer(lags))
        assert ", ".join(m[0] for m in found) == lags, lags
        steps = [int(m[1]) for m in found]
        assert steps[-1] == 12 and set(steps) <= {4, 8, 12}, lags
    replica = (out / "bf16-b" / "run.args").read_text().splitlines()
    assert "--seed=43" in replica and "--data_seed=42" in replica
    assert "--bf16_layers=0,-1" in (out / "fp8-closer" / "run.args").read_text().splitlines()
    for arm in ("bf16-a", "bf16-b", "fp8", "fp8-current", "fp8-closer"):  # trained at once
        assert "Batch 12 Loss:" in (out / f"{arm}.log").read_text(), arm
    again = long_ab(out, "--arms", "none")
    assert again.returncode == 0 and (out / "verdict.txt").read_text() == verdict
