"""--sharding_strategy none: a world of one without FSDP2. The model stays as built (no DTensor,
no FSDP2 hooks), torch.autocast computes in bf16 with the residual stream in bf16 as FSDP2's
bf16 parameters give it, it trains like the FSDP2 run on every backend, and its checkpoints
move to FSDP2 and back exactly. On it, --cuda_graphs' capture of TE's layers (the TE double
holds the capture and replay contract of TE's make_graphed_callables; CUDA graphs need a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers.inprocess import Run, batch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import te_llama
from model_utils.parallel.distributed import decoder_layers
from model_utils.report.run_log import evaluate

NONE = ("--bf16=1", "--sharding_strategy", "none")
FULL = ("--bf16=1",)

BACKENDS = [
    pytest.param("hf", False, id="hf-bf16"),
    pytest.param("hf", True, id="hf-torchao_fp8"),
    pytest.param("te", False, id="te-bf16"),
    pytest.param("te", True, id="te-fp8"),
    pytest.param("te_linear", True, id="te_linear-fp8"),
]


def first_step(run: Run) -> tuple[float, set[torch.dtype]]:
    """The first step's loss, and the dtype of each decoder layer's output in its forward (the
    residual stream)."""
    seen: set[torch.dtype] = set()

    def record(module, args, output) -> None:
        seen.add((output[0] if isinstance(output, tuple) else output).dtype)

    hooks = [layer.register_forward_hook(record) for layer in decoder_layers(run.model)]
    loss = run.step(seed=0)
    for hook in hooks:
        hook.remove()
    return loss, seen


@pytest.mark.parametrize(("impl", "fp8"), BACKENDS)
def test_without_fsdp2_a_world_of_one_trains_like_fsdp2(impl, fp8, tmp_path, te_double) -> None:
    fsdp2 = Run(impl, fp8, seed=1, checkpoint_dir=tmp_path / "full", flags=FULL)
    plain = Run(impl, fp8, seed=1, checkpoint_dir=tmp_path / "none", flags=NONE)
    assert isinstance(fsdp2.model, FSDPModule) and not isinstance(plain.model, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}  # the master weights
    assert "torch.autocast" in plain.backend.describe()

    (plain_loss, plain_dtypes), (fsdp2_loss, fsdp2_dtypes) = first_step(plain), first_step(fsdp2)
    assert plain_dtypes == fsdp2_dtypes == {torch.bfloat16}
    if not fp8:  # one model computed the same (FP8 casts read the fp32 weights, not bf16 ones)
        assert plain_loss == fsdp2_loss
    losses = {
        name: [run.step(seed=s) for s in (1, 2, 1)]
        for name, run in (("full", fsdp2), ("none", plain))
    }
    assert losses["none"] == pytest.approx(losses["full"], rel=1e-3)
    assert losses["none"][2] < losses["none"][0]  # the same batch again: learned


@pytest.mark.parametrize("direction", ["none->full", "full->none"])
def test_a_checkpoint_moves_between_fsdp2_and_a_plain_model_exactly(direction, tmp_path) -> None:
    """DCP saves plain tensors and DTensor shards alike: weights, AdamW moments and the schedule
    arrive exactly, and the next step computes what the saving run's next step computes."""
    saved_flags, loaded_flags = (NONE, FULL) if direction == "none->full" else (FULL, NONE)
    saved = Run("hf", True, seed=1, checkpoint_dir=tmp_path / "a", flags=saved_flags)
    for s in range(2):
        saved.step(seed=s)
    path = saved.checkpointer.save(2, saved.state)

    loaded = Run("hf", True, seed=2, checkpoint_dir=tmp_path / "b", flags=loaded_flags)
    loaded.checkpointer.load(path, loaded.state)
    assert loaded.state.step == 2
    for got, want in (
        (loaded.hf_weights(), saved.hf_weights()),
        (loaded.hf_moments("exp_avg"), saved.hf_moments("exp_avg")),
        (loaded.hf_moments("exp_avg_sq"), saved.hf_moments("exp_avg_sq")),
    ):
        assert set(got) == set(want)
        assert all(torch.equal(got[name], want[name]) for name in want)
    assert loaded.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert loaded.step(seed=5) == pytest.approx(saved.step(seed=5), rel=1e-3)


def test_cuda_graphs_capture_each_te_layer_at_the_training_shape(tmp_path, te_double) -> None:
    """Captured after the build (training mode, the step's shape and dtype, no autocast weight
    cache, no hooks, a BF16-kept layer without FP8), every training call replays what was
    captured and trains exactly as the uncaptured twin; validation (eval mode) runs eagerly."""
    flags = (*NONE, "--bf16_layers=0")
    eager = Run("te", True, seed=1, checkpoint_dir=tmp_path / "eager", flags=flags)
    graphed = Run("te", True, seed=1, checkpoint_dir=tmp_path / "graphed", flags=flags)
    micro_batch, seq_len = batch(0).shape
    te_llama.capture_cuda_graphs(graphed.model, graphed.backend, micro_batch, seq_len)
    layers = decoder_layers(graphed.model)
    assert all(layer.graphed for layer in layers)
    assert all("forward" in vars(layer.transformer_layer) for layer in layers)  # replaced
    held_out = [{"input_ids": batch(7)[:1], "labels": batch(7)[:1]}]  # another shape: eager

    def train_then_validate(run: Run) -> tuple[list[float], float]:
        # one run after the other: TE's delayed scaling keeps every model's modules in one
        # process-wide amax buffer, and each step's update rolls the other model's history too
        losses = [run.step(seed=s) for s in (1, 2, 1)]
        return losses, evaluate(run.model, held_out, run.backend, torch.device("cpu"))

    eager_losses, eager_val = train_then_validate(eager)
    graphed_losses, graphed_val = train_then_validate(graphed)
    assert graphed_losses == eager_losses and graphed_losses[2] < graphed_losses[0]
    assert graphed_val == eager_val


@pytest.mark.parametrize("flags", [FULL, NONE], ids=["fsdp2", "none"])
def test_without_fsdp2_te_keeps_a_steps_fp8_weights_across_its_micro_batches(
    flags, tmp_path, te_double
) -> None:
    """FSDP2 gathers the weights anew for every forward, so TE's FP8 weight cache stays off
    there (is_first_microbatch None); without FSDP2 the step's first micro-batch casts them and
    the others reuse the cast (TE's cache, filled)."""
    run = Run("te", True, seed=1, checkpoint_dir=tmp_path, flags=(*flags, "--grad_accum_steps=2"))
    losses = [run.step(seed=s) for s in (1, 1)]
    cached = [m for m in run.model.modules() if getattr(m, "_weight_cache", None)]
    assert bool(cached) == (flags == NONE)
    assert losses[1] < losses[0]
