"""analysis/compare_runs.py on a real train.py run: its log and its run directory read the same;
--tracker's comparison run read back from a real W&B offline run and MLflow store."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.procs import PYTHON
from helpers.wandb_offline import read_run

from analysis import compare_runs as cr
from analysis import parity
from model_utils.config.arguments import parse_args
from model_utils.report import metrics

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


# ---------------------------------------------------------------------- the A/B in trackers


def _run_folder(path: Path, loss_factor: float, **flags: object) -> Path:
    """A 40-step run folder trained with --tracker wandb,mlflow: its losses `loss_factor` times
    a falling curve."""
    resolved = parse_args(["--preset", "tiny", "--max_steps", "40"]).as_dict()
    resolved.update(model_impl="hf", fp8_recipe="tensorwise", tracker="wandb,mlflow", **flags)
    with metrics.JsonlWriter(path / "metrics.jsonl") as writer:
        writer.write(metrics.run_record(resolved, world_size=1, samples_per_step=4))
        for step in range(1, 41):
            loss = loss_factor * (8.0 - step / 10)
            writer.write({"kind": "train", "step": step, "loss": loss, "samples_per_sec": 4.0})
    return path


def test_wandb_and_mlflow_get_the_gap_band_picture_and_verdict(tmp_path: Path) -> None:
    """``--tracker runs`` (the runs' W&B and MLflow, offline and in the default store beside
    them): one comparison run in each, tagged ``compare``, with the gap per step, the band,
    the very PNG written and the printed verdict and report."""
    pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")
    pytest.importorskip("wandb", reason="pip install -e '.[trackers]'")
    from mlflow.tracking import MlflowClient

    runs = tmp_path / "runs"
    bf16 = _run_folder(runs / "tiny-bf16", 1.0)
    fp8 = _run_folder(runs / "tiny-fp8", 1.004, fp8=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(ROOT), WANDB_PROJECT="ab-test", MLFLOW_EXPERIMENT_NAME="ab-test")
    for folder in ("CONFIG", "CACHE", "DATA"):
        env[f"WANDB_{folder}_DIR"] = str(tmp_path / f"wandb-{folder.lower()}")
    command = [PYTHON, "-m", "analysis.compare_runs", str(bf16), str(fp8), "--tracker", "runs"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = done.stdout.split("\nThe comparison in the trackers")[0]
    verdict = (
        "fp8 tensorwise hf matches bf16 hf over steps 4-40: the train loss gap +0.40% over the "
        "last judged steps is inside ±1.00%"
    )
    assert f"  verdict: {verdict}" in report
    picture = (fp8 / "compare_runs.png").read_bytes()
    records = [cr.load_run(p).records for p in (bf16, fp8)]
    judged = parity.gaps_of(records[1], records[0], 4)
    steps, gaps = judged.whole, judged.train
    gap = {s: 100 * g for s, g in zip(steps, gaps, strict=True)}
    key = "compare/train_loss_gap_pct/fp8 tensorwise hf"

    home = runs / "compare-tiny-bf16-vs-tiny-fp8"
    [file] = home.glob("wandb/offline-run-*/run-*.wandb")
    run = read_run(file)
    assert run["project"] == "ab-test" and run["tags"] == ["compare"]
    assert run["config"]["labels"] == "bf16 hf, fp8 tensorwise hf"
    assert run["summary"]["verdict"] == verdict
    assert {s: row[key] for s, row in run["history"].items()} == pytest.approx(gap)
    assert {row["compare/band_pct"] for row in run["history"].values()} == {1.0}
    last = run["history"][40]
    assert last["compare/picture/sha256"] == hashlib.sha256(picture).hexdigest()
    assert (file.parent / "files" / last["compare/picture/path"]).read_bytes() == picture
    assert last["compare/report/_type"] == "html-file"

    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ab-test")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == home.name and found.data.tags["kind"] == "compare"
    assert found.data.tags["verdict"] == verdict
    history = client.get_metric_history(found.info.run_id, key)
    assert {m.step: m.value for m in history} == pytest.approx(gap)
    artifacts = Path(client.download_artifacts(found.info.run_id, "", str(tmp_path / "got")))
    assert (artifacts / "compare_runs.png").read_bytes() == picture
    assert (artifacts / "compare_runs.txt").read_text() == report
    assert not (tmp_path / "mlruns").exists()  # the default store's artifacts are beside it
