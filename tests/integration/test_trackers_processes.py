"""--tracker from real train.py runs and their resumes: a real MLflow tracking server (SQLite
backend) gets every metric of a 2-rank run and its resume in one run; W&B offline writes a run
that wandb's own protobuf reads back, and the resume continues that run id."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.endpoints import silent_hub
from helpers.procs import free_port
from helpers.runs import FAST, ROOT, records, train_cmd, train_env
from helpers.wandb_offline import read_run

from model_utils.report import trackers

pytest.importorskip("mlflow", reason="pip install -e '.[trackers]'")
pytest.importorskip("wandb", reason="pip install -e '.[trackers]'")

COMMON = [*FAST, "--max_context_width=64", "--warmup=1", "--validation_batches=1"]
COMMON += ["--validation_freq=2", "--checkpoint_freq=2"]


def _train(out: Path, max_steps: int, env: dict[str, str | None], nproc: int, *extra: str) -> str:
    """train.py with `env` over the test's environment (a None value: unset)."""
    merged = {k: v for k, v in {**train_env(), **env}.items() if v is not None}
    argv = [*COMMON, f"--max_steps={max_steps}", f"--output_dir={out}", *extra]
    argv.append("--resume_from_checkpoint=auto")
    done = subprocess.run(
        train_cmd(*argv, nproc=nproc),
        capture_output=True,
        text=True,
        timeout=600,
        env=merged,
        cwd=ROOT,
    )
    first_rank = [line for line in done.stderr.splitlines() if line.startswith("[rank0]")]
    assert done.returncode == 0, "\n".join(
        [done.stdout[-3000:], *first_rank[:40], done.stderr[-2000:]]
    )
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on a free port with a SQLite backend, until the module's tests end."""
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri",
            f"sqlite:///{home / 'mlflow.db'}",
            "--default-artifact-root",
            str(home / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(home / "server.log").open("w"),
        cwd=home,
        start_new_session=True,
        # without the server's job runner (huey consumers for MLflow's own jobs, ~20 CPU s in
        # this module): the recipe logs runs and metrics, which the server answers itself
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                break
        except OSError:
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer in 120 s"
            time.sleep(0.5)
    yield uri
    os.killpg(server.pid, 15)
    server.wait(timeout=30)


def test_mlflow_gets_every_metric_of_a_2_rank_run_and_its_resume_in_one_run(
    tmp_path: Path, mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    env: dict[str, str | None] = {
        "MLFLOW_TRACKING_URI": mlflow_server,
        "MLFLOW_EXPERIMENT_NAME": "ab-test",
    }
    first = _train(out, 4, env, 2, "--tracker=mlflow")
    run_id = trackers.read_ids(out)["mlflow"]
    assert f"mlflow: run {run_id}" in first
    resumed = _train(out, 6, env, 2, "--tracker=mlflow")
    assert f"mlflow: continuing run {run_id}" in resumed
    assert trackers.read_ids(out) == {"mlflow": run_id}

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("ab-test")
    found = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in found] == [run_id]  # the resume made no second run
    run = found[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["precision"] == "fp32" and run.data.tags["output_dir"] == str(out)
    assert run.data.params["max_steps"] == "4" and run.data.params["world_size"] == "2"
    train, val = records(out), records(out, "val")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for kind, rows in (("train", train), ("val", val)):
        for key, _ in trackers.numbers(rows[0]).items():
            history = client.get_metric_history(run_id, key)
            got = {m.step: m.value for m in history}
            want = {r["step"]: trackers.numbers(r)[key] for r in rows}
            assert got == pytest.approx(want, rel=1e-6), (kind, key)
    assert "train/loss" in run.data.metrics and "val/val_loss" in run.data.metrics
    assert all(r["grad_norm"] > 0 for r in train) and "train/grad_norm" in run.data.metrics


def test_wandb_offline_writes_a_run_wandb_reads_back_and_a_resume_continues_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    env: dict[str, str | None] = {
        "WANDB_PROJECT": "ab-test",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_MODE": None,  # no key, no mode: offline, as on a compute node without internet
        "WANDB_API_KEY": None,
    }
    first = _train(out, 2, env, 1, "--tracker=wandb,tensorboard")
    run_id = trackers.read_ids(out)["wandb"]
    assert f"wandb: run {run_id}" in first
    assert "wandb: offline, no WANDB_API_KEY (WANDB_MODE=online uses `wandb login`'s)" in first
    assert (out / "tensorboard").is_dir()
    _train(out, 4, env, 1, "--tracker=wandb")
    assert trackers.read_ids(out) == {"wandb": run_id}

    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    segments = [read_run(f) for f in files]
    assert all(s["id"] == run_id and s["project"] == "ab-test" for s in segments)
    assert all(s["tags"] == ["fp32"] for s in segments)
    assert segments[0]["config"]["max_steps"] == 2 and segments[0]["config"]["bf16"] is False
    history = {**segments[0]["history"], **segments[1]["history"]}
    assert sorted(segments[0]["history"]) == [1, 2] and sorted(segments[1]["history"]) == [3, 4]
    train, val = records(out), records(out, "val")
    for row in [*train, *val]:
        for key, value in trackers.numbers(row).items():
            assert history[row["step"]][key] == pytest.approx(value, rel=1e-6), key


def test_a_tracker_server_that_never_answers_never_stalls_training(tmp_path: Path) -> None:
    """A tracking server that takes the connection and never answers: the run trains its steps
    and saves while the tracker's start is stuck (the last step is logged before the server
    lets go), --hang_timeout does not count it, and the tracker costs one W line."""
    out = tmp_path / "run"
    env = {
        **train_env(),
        "MLFLOW_TRACKING_URI": "set below",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    argv = [*COMMON, "--max_steps=4", f"--output_dir={out}", "--tracker=mlflow"]
    argv.append("--hang_timeout=30")
    lines: list[str] = []
    held = None
    with silent_hub(hold=True) as server:
        env["MLFLOW_TRACKING_URI"] = server.url
        with subprocess.Popen(
            train_cmd(*argv, nproc=1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if "Batch 4 Loss:" in line:
                    held = server.connections
                    server.release()
            code = proc.wait(timeout=300)
    log = "".join(lines)
    assert code == 0, log[-3000:]
    assert held == 1, log[-3000:]  # the tracker was waiting on the server when step 4 was done
    warnings = [line for line in lines if " W [" in line]
    assert len(warnings) == 1 and "mlflow cannot start (" in warnings[0], warnings
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert not (out / "hang").exists()  # the watchdog never counted the tracker's wait
