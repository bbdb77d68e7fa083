"""Checkpoints across implementations through ``train.py`` under torchrun with 2 ranks (fp32
compute, TE on the TE test double): hf trains, te resumes from its checkpoint, hf resumes from
te's, every loss matches the uninterrupted hf run, and each run saved its own layout."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers.inprocess import SMALL
from helpers.procs import launch_report, torchrun_cmd, warm_env
from te_double import subprocess_env

from model_utils.checkpoint.layout import param_layout
from model_utils.checkpoint.manifest import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


# ============================================================================================
# train.py, 2 ranks


def run_train(*argv: str, nproc: int = 2) -> str:
    env = subprocess_env({**warm_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    cmd = torchrun_cmd(str(ROOT / "train.py"), *SMALL, *argv, nproc=nproc)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, launch_report(result)
    return result.stdout


def records(run_dir: Path) -> dict[tuple[str, int], float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    out = {}
    for record in map(json.loads, lines):
        if record["kind"] in ("train", "val"):
            key = "loss" if record["kind"] == "train" else "val_loss"
            out[(record["kind"], record["step"])] = record[key]
    return out


@pytest.mark.slow
def test_train_py_two_ranks_hf_to_te_and_back(tmp_path) -> None:
    """torchrun, 2 ranks, fp32: hf trains 6 steps; te resumes from hf's step 2 and trains to 4;
    hf resumes from te's step 4 and trains to 6. Every train and validation loss matches the
    uninterrupted hf run: weights, AdamW moments, LR and data position all crossed over."""
    common = ["--max_steps=6", "--validation_freq=2", "--checkpoint_freq=2", "--keep_last=0"]
    common += ["--bf16=0"]  # fp32 compute: hf and the TE double then agree to float rounding
    reference, te_run, back = tmp_path / "hf", tmp_path / "te", tmp_path / "back"
    run_train(*common, "--model_impl=hf", f"--output_dir={reference}")
    out = run_train(
        *common,
        "--model_impl=te",
        "--max_steps=4",
        f"--output_dir={te_run}",
        f"--resume_from_checkpoint={reference / 'checkpoints' / 'step_00000002'}",
    )
    assert "impl=te" in out and "at step 2" in out
    run_train(
        *common,
        "--model_impl=hf",
        f"--output_dir={back}",
        f"--resume_from_checkpoint={te_run / 'checkpoints' / 'step_00000004'}",
    )
    want = records(reference)
    got = {**records(te_run), **records(back)}
    assert sorted(got) == sorted(k for k in want if k[1] > 2)
    for key, value in got.items():
        assert value == pytest.approx(want[key], rel=2e-6), key
    # --model_impl took effect: each run saved its own parameter layout, not just its log line.
    saved = [reference / "checkpoints", te_run / "checkpoints", back / "checkpoints"]
    metas = [dcp.FileSystemReader(str(latest_checkpoint(d))).read_metadata() for d in saved]
    layouts = [param_layout(meta.state_dict_metadata) for meta in metas]
    assert layouts == ["hf", "te", "hf"]


def test_train_py_fp8_weights_with_fp32_masters_on_two_ranks_resume_exactly(tmp_path) -> None:
    """--fp8_weights --master_weights optimizer through train.py on the TE double, 2 ranks: it
    trains, resumes from step 4 bit for bit, and the same checkpoint resumes with --fp8_weights
    off (the parameters are saved as plain bf16 values beside the fp32 masters).

    Delayed scaling with a validation just before the save: TE leaves an inference forward's
    amaxes unreduced in each rank's history until the next training forward, so this resume is
    exact only because validation keeps its amaxes out of the training state."""
    common = ["--model_impl=te", "--fp8=1", "--fp8_recipe=delayed", "--max_steps=8"]
    common += ["--master_weights=optimizer", "--amax_history_len=4", "--validation_freq=4"]
    full, resumed, plain = tmp_path / "full", tmp_path / "resumed", tmp_path / "plain"
    out = run_train(*common, "--fp8_weights", "--checkpoint_freq=4", f"--output_dir={full}")
    assert "weights FP8 (fp8_model_init)" in out
    assert "fp32 master weights in the optimizer" in out
    step4 = f"--resume_from_checkpoint={full / 'checkpoints' / 'step_00000004'}"
    run_train(*common, "--fp8_weights", step4, f"--output_dir={resumed}")
    want, got = records(full), records(resumed)
    assert want[("train", 8)] < want[("train", 1)]
    assert sorted(got) == sorted(k for k in want if k[1] > 4)
    assert got == {k: want[k] for k in got}  # exact
    out = run_train(*common, step4, f"--output_dir={plain}")
    assert "fp8_weights" in out  # the changed flag is named, the resume goes on
    assert records(plain)[("train", 8)] == pytest.approx(want[("train", 8)], rel=0.02)


@pytest.mark.slow
def test_train_py_fp8_numerics_on_the_fused_layers_two_ranks(tmp_path) -> None:
    """--fp8_numerics on --model_impl te: TE's debug tools start before the model, every rank
    steps them (their statistics are reduced over the ranks: a rank that did not would hang
    the other), and rank 0's metrics.jsonl holds the fused GEMMs' figures at the report steps,
    the layer kept in BF16 left out."""
    out = tmp_path / "te-numerics"
    flags = "--model_impl te --fp8=1 --fp8_numerics --bf16_layers 0 --max_steps 4"
    stdout = run_train(*flags.split(), "--logging_freq", "2", "--output_dir", str(out))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    found = [r for r in map(json.loads, lines) if r["kind"] == "numerics"]
    assert [r["step"] for r in found] == [2, 4]
    layers = found[-1]["layers"]
    names = {name.split("transformer_layer.")[-1] for name in layers}
    assert names == {
        "self_attention.layernorm_qkv",
        "self_attention.proj",
        "layernorm_mlp.fc1",
        "layernorm_mlp.fc2",
    }
    assert all(name.startswith("model.layers.1.") for name in layers)
    assert found[-1]["grad_underflow_pct_max"] >= 0
    assert "FP8 numerics at step 4 (4 linears): worst underflow" in stdout
    tools = out / "fp8_numerics"  # the config both ranks wrote, whole; each rank's own log
    assert [p.name for p in tools.iterdir() if p.is_file()] == ["config.yaml"]
    logs = sorted(p.name for p in (tools / "nvdlfw_inspect_logs").iterdir())
    assert logs == ["nvdlfw_inspect_globalrank-0.log", "nvdlfw_inspect_globalrank-1.log"]
