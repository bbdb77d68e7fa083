"""--tensorboard from a real train.py run: scalars and flags from rank 0, read back by
TensorBoard's own reader; the ETA in the second log line."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers.procs import torchrun_cmd, warm_env
from helpers.tensorboard_events import flags_text, read_events, series

from model_utils.report import metrics
from model_utils.report.metrics.meter import remaining_seconds

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real 2-rank train.py run with --tensorboard (its stdout, i.e. rank 0's log)."""
    out = tmp_path_factory.mktemp("tb") / "run"
    cmd = torchrun_cmd(
        str(ROOT / "train.py"),
        "--preset",
        "tiny",
        "--train_batch_size",
        "2",
        "--max_context_width",
        "64",
        "--max_steps=12",
        "--bf16=0",  # fp32 compute: bf16 matmuls are 20-60x slower on a CPU without bf16 units
        "--warmup=2",
        "--logging_freq=2",
        "--validation_freq=6",
        "--validation_batches=1",
        "--tensorboard",
        f"--output_dir={out}",
        nproc=2,
    )
    env = {**warm_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_train_writes_every_logged_metric_from_rank_0(two_rank_run: tuple[Path, str]) -> None:
    out, _ = two_rank_run
    files = list((out / "tensorboard").iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents")  # rank 0 only
    records = metrics.read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12] and [r["step"] for r in val] == [
        6,
        12,
    ]
    events = read_events(out / "tensorboard")
    keys = (
        "loss",
        "lr",
        "samples_per_sec",
        "tokens_per_sec_per_device",
        "tflops_per_device",
        "peak_mem_gib",
        "data_wait_pct",
        "elapsed_seconds",
    )
    for key in keys:
        want = {r["step"]: r[key] for r in train}
        assert series(events, f"train/{key}") == pytest.approx(want, rel=1e-6), key
    assert series(events, "val/val_loss") == pytest.approx({r["step"]: r["val_loss"] for r in val})
    assert "train/mfu" not in events.Tags()["scalars"]  # None on CPU: no chart of zeros
    text = flags_text(events)
    assert "| tensorboard | True |" in text and "| world_size | 2 |" in text
    assert "| samples_per_step | 4 |" in text and "| max_steps | 12 |" in text


def test_second_log_line_has_elapsed_and_remaining_time(two_rank_run: tuple[Path, str]) -> None:
    out, stdout = two_rank_run
    details = [ln for ln in stdout.splitlines() if "tokens/s/device:" in ln]
    assert len(details) == 6
    found = [re.search(r", elapsed: (\S+), remaining: (.+)$", ln) for ln in details]
    assert all(found), details
    # Warm-up is min(10, max_steps // 2) = 6 steps: the windows ending at steps 2, 4, 6 are in it.
    assert [m.group(2) for m in found[:3]] == ["n/a (warm-up)"] * 3
    assert all(m.group(2).startswith("~") for m in found[3:]) and found[-1].group(2) == "~0s"
    train = [r for r in metrics.read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    step_times = [r["step_seconds"] / r["window_steps"] for r in train[3:]]
    want = remaining_seconds(step_times[:1], 12 - 8)
    assert train[3]["remaining_seconds"] == pytest.approx(want)
    assert found[3].group(2) == f"~{metrics.format_duration(want)}"
    assert [m.group(1) for m in found] == [
        metrics.format_duration(r["elapsed_seconds"]) for r in train
    ]
    elapsed = [r["elapsed_seconds"] for r in train]
    assert elapsed == sorted(elapsed) and json.dumps(train[-1])  # strict JSON
