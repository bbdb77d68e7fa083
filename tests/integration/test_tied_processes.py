"""Tied embeddings (Llama 3.2) through ``train.py`` under torchrun with 2 ranks, fp32, TE on the
TE test double: a transformers-saved tied checkpoint trains as one matrix under FSDP2 (with
AC), its DCP checkpoint resumes across implementations with the
uninterrupted run's losses, its export is a tied Llama again, and an untied resume of it is
refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.inprocess import SMALL
from helpers.procs import PYTHON, launch_report, torchrun_cmd, warm_env
from te_double import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
#: The tied checkpoint's shape: SMALL's (the tiny preset cut down), so a resume can name it by
#: flags; only tie_word_embeddings differs from the tiny preset.
SHAPE = dict(
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True,
)
COMMON = ["--bf16=0", "--train_batch_size=2", "--warmup=1", "--validation_batches=1"]
COMMON += ["--activation_checkpointing=1", "--keep_last=0"]


def run_train(*argv: str) -> str:
    env = subprocess_env({**warm_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    cmd = torchrun_cmd(str(ROOT / "train.py"), *argv, nproc=2)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, launch_report(result)
    return result.stdout


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """hf from the tied HF folder, 4 steps (checkpoints at 2 and 4, export); te resumed from
    hf's step 2 to 4 in its own folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(str(root / "hf_in"))
    hf, te = root / "hf", root / "te"
    run_train(
        *COMMON,
        f"--init_from_hf={root / 'hf_in'}",
        "--model_impl=hf",
        "--max_context_width=32",
        "--max_steps=4",
        "--checkpoint_freq=2",
        f"--output_dir={hf}",
        f"--export_hf={root / 'export'}",
    )
    run_train(
        *SMALL,
        *COMMON,
        "--tie_word_embeddings=1",
        "--model_impl=te",
        "--max_steps=4",
        f"--output_dir={te}",
        f"--resume_from_checkpoint={hf / 'checkpoints' / 'step_00000002'}",
    )
    return {"hf": hf, "te": te, "export": root / "export", "hf_in": root / "hf_in"}


@pytest.mark.slow
def test_two_ranks_train_one_matrix_and_resume_across_implementations(runs) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want, got = losses(runs["hf"]), losses(runs["te"])
    assert want[4] < want[1]
    assert sorted(got) == [3, 4]
    for step, loss in got.items():  # fp32: hf and the TE double agree to float rounding
        assert loss == pytest.approx(want[step], rel=2e-5), step
    # Both ranks stepped one parameter: wherever the checkpoint names it twice, it is one value.
    for run in ("hf", "te"):
        flat = runs[run] / "flat.pt"
        dcp_to_torch_save(str(runs[run] / "checkpoints" / "step_00000004"), str(flat))
        model = torch.load(flat, weights_only=False)["model"]
        embedding = model["model.embed_tokens.weight"]
        assert torch.equal(model.get("lm_head.weight", embedding), embedding), run


@pytest.mark.slow
def test_the_export_and_the_converter_write_a_tied_llama_again(runs, tmp_path) -> None:
    """--export_hf at the end of the run, and the converter from the te run's DCP checkpoint."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    converted = tmp_path / "converted"
    step_4 = runs["te"] / "checkpoints" / "step_00000004"
    subprocess.run(
        [PYTHON, "-m", "scripts.convert_checkpoint", str(step_4), str(converted)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    loaded = LlamaForCausalLM.from_pretrained(str(runs["hf_in"]), dtype=torch.float32)
    for folder in (runs["export"], converted):
        config = json.loads((folder / "config.json").read_text())
        assert config["tie_word_embeddings"] is True
        with safe_open(str(folder / "model.safetensors"), framework="pt") as stored:
            assert "lm_head.weight" not in stored.keys()
        model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not torch.equal(model.lm_head.weight, loaded.lm_head.weight)  # it trained


@pytest.mark.slow
def test_an_untied_resume_of_a_tied_checkpoint_is_refused(runs, refused_by_train) -> None:
    _, lines, _ = refused_by_train(
        *SMALL,
        *COMMON,
        "--model_impl=hf",
        "--max_steps=6",
        f"--output_dir={runs['hf'].parent / 'untied'}",
        f"--resume_from_checkpoint={runs['hf'] / 'checkpoints' / 'step_00000004'}",
    )
    assert len(lines) == 1 and "--tie_word_embeddings True -> False" in lines[0], lines
