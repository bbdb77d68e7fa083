"""--optimizer adamw8bit | adamw_fp8: torchao's AdamW with 8-bit / FP8 moments (optim.py), in
this process: the same parameter groups, betas, eps, decay and schedule as torch's AdamW; a first
step that moves the weights as AdamW does (within quantisation error); the LR schedule on
torchao's tensor lr (resume and an explicit --lr); the refusals (--async_checkpoint, a reshard
that would cut a quantisation block) and a checkpoint converted across parameter layouts (TE
test double). train.py on 2 ranks: tests/integration/test_low_bit_optim_processes.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.inprocess import Run, tiny_llama, to_hf
from helpers.optimizers import LOW_BIT, STATE_CLASS, dequantized, group_names, local_tensor

from model_utils import optim
from model_utils.checkpoint.layout import low_bit_reshard_problem
from model_utils.checkpoint.resume import config_changes
from model_utils.config.arguments import UsageError, parse_args

# ============================================================================================
# In this process


@pytest.mark.parametrize("name", LOW_BIT)
def test_same_groups_and_settings_and_a_first_step_like_adamw(name: str) -> None:
    """Groups (decay / no decay, names), lr, betas, eps and weight decay as torch's AdamW; one
    step with real gradients moves every weight as AdamW does, within the moments' rounding;
    the big tensors' moments are torchao's quantised states, the norm gains' stay fp32; the
    state bytes are what torchao's layout implies (AdamW: 8 per parameter)."""
    reference, model = tiny_llama(), tiny_llama()
    ours = optim.build_optimizer(model, 1e-3, 0.1, 0.9, 0.95, name)
    adamw = optim.build_optimizer(reference, 1e-3, 0.1, 0.9, 0.95)
    assert type(ours).__name__ == {"adamw8bit": "AdamW8bit", "adamw_fp8": "AdamWFp8"}[name]
    assert group_names(ours.param_groups) == group_names(adamw.param_groups)
    for got, want in zip(ours.param_groups, adamw.param_groups, strict=True):
        assert got["param_names"] == want["param_names"]
        assert (got["weight_decay"], got["betas"], got["eps"]) == (
            want["weight_decay"],
            want["betas"],
            want["eps"],
        )
        assert isinstance(got["lr"], torch.Tensor) and float(got["lr"]) == pytest.approx(1e-3)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for m, opt in ((reference, adamw), (model, ours)):
        m(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        ours_delta, adamw_delta = p.detach() - before[n], q.detach() - before[n]
        error = (ours_delta - adamw_delta).abs().mean() / adamw_delta.abs().mean()
        assert error < 0.02, (n, float(error))  # the update is ~lr * sign(g) at step 1

    kinds = {
        n: type(local_tensor(ours.state[p]["exp_avg"])).__name__
        for n, p in model.named_parameters()
    }
    assert kinds["model.embed_tokens.weight"] == STATE_CLASS[name]
    assert kinds["model.layers.0.mlp.up_proj.weight"] == STATE_CLASS[name]
    assert kinds["model.norm.weight"] == "Tensor"  # < 4096 values: torchao keeps them fp32
    # Bytes by torchao's rule: per moment 1-byte codes + an fp32 scale per 256 values (+ the
    # 8-bit quantile map, 256 fp32) where quantised, else fp32; plus the fp32 step.
    qmap = 256 * 4 if name == "adamw8bit" else 0
    expected = 0
    for p in model.parameters():
        quantized = p.numel() >= 4096 and p.numel() % 256 == 0
        expected += 4 + 2 * (
            (p.numel() + p.numel() // 256 * 4 + qmap) if quantized else 4 * p.numel()
        )
    assert optim.optimizer_state_bytes(ours) == expected
    params = sum(p.numel() for p in model.parameters())
    assert optim.optimizer_state_bytes(adamw) == 8 * params + 4 * len(list(model.parameters()))


@pytest.mark.parametrize("name", LOW_BIT)
def test_schedule_on_torchaos_tensor_lr_resumes_exactly_and_takes_an_explicit_lr(
    name: str,
) -> None:
    """torchao holds each group's lr as a 0-d fp32 tensor: LambdaLR fills it in place, a resumed
    schedule gives the same bits as the uninterrupted one, and an explicit --lr on resume
    replaces it (still a tensor, which torchao's step insists on)."""
    settings = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "max_steps": 10, "style": "cosine"}

    def schedule():
        opt = optim.build_optimizer(tiny_llama(), 1e-3, 0.1, 0.9, 0.95, name)
        return opt, optim.build_scheduler(opt, **settings)

    opt, sched = schedule()
    for _ in range(4):
        sched.step()  # (no optimizer step: only the lr matters here)
    saved = sched.state_dict()
    sched.step()
    want = [g["lr"].clone() for g in opt.param_groups]

    opt2, sched2 = schedule()
    sched2.load_state_dict(saved)
    for group, lr in zip(opt2.param_groups, saved["_last_lr"], strict=True):
        group["lr"].copy_(lr)  # what loading the optimizer's param groups does
    assert optim.resume_schedule(sched2, {}) == {"lr": 1e-3, "min_lr": 1e-4}
    sched2.step()
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt2.param_groups)
    assert [g["lr"] for g in opt2.param_groups] == want  # bit for bit
    assert float(sched2.get_last_lr()[0]) == float(want[0])

    optim.resume_schedule(sched2, {"lr": 5e-4})
    expected = optim.lr_at(6, **{**settings, "lr": 5e-4})
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt2.param_groups)
    assert float(opt2.param_groups[0]["lr"]) == pytest.approx(expected, rel=1e-6)


def test_flag_and_the_refused_combinations() -> None:
    assert parse_args([]).optim.optimizer == "adamw"
    assert parse_args(["--optimizer", "adamw_fp8"]).optim.optimizer == "adamw_fp8"
    with pytest.raises(UsageError, match="invalid choice"):
        parse_args(["--optimizer", "adam4bit"])
    with pytest.raises(UsageError, match="aten.new_empty.*: it needs --optimizer adamw$"):
        parse_args(["--optimizer", "adamw8bit", "--async_checkpoint"])
    assert parse_args(["--optimizer", "adamw", "--async_checkpoint"]).checkpoint.async_checkpoint

    # A resume keeps the saved optimizer; checkpoints from before the flag are adamw's.
    refused, _ = config_changes({"optimizer": "adamw8bit"}, {"optimizer": "adamw"})
    assert refused == [("--optimizer", "adamw8bit", "adamw")]
    refused, _ = config_changes({"seed": 1}, {"seed": 1, "optimizer": "adamw_fp8"})
    assert refused == [("--optimizer", "adamw", "adamw_fp8")]
    assert config_changes({"seed": 1}, {"seed": 1, "optimizer": "adamw"}) == ([], [])


def _fake_metadata(shape: tuple[int, ...], row_splits: list[int]):
    """DCP metadata of one exp_avg saved in row blocks (one per saved rank)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    bounds = [0, *row_splits, shape[0]]
    chunks = [
        ChunkStorageMetadata(torch.Size([a, 0]), torch.Size([b - a, shape[1]]))
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    return Metadata(state_dict_metadata={"optimizer.state.weight.exp_avg": md})


@pytest.mark.parametrize("name", LOW_BIT)
def test_reshard_is_refused_only_where_a_cut_falls_inside_a_block(name: str) -> None:
    """The tiny preset's down_proj is 256 x 688: saved by 2 ranks (rows 0-128, 128-256) every
    cut is whole blocks of 256 values; saved by 3 ranks (rows 0-86, ...) one is not."""
    model = torch.nn.Linear(688, 256, bias=False)
    opt = optim.build_optimizer(model, 1e-3, 0.1, 0.9, 0.95, name)
    p = model.weight
    opt.state[p] = {  # torchao's own lazy state (what its first step creates), without a step
        "step": torch.tensor(0.0),
        "exp_avg": opt._new_buffer(p, True),
        "exp_avg_sq": opt._new_buffer(p, False),
    }
    assert type(opt.state[p]["exp_avg"]).__name__ == STATE_CLASS[name]
    assert low_bit_reshard_problem(_fake_metadata((256, 688), [128]), model, opt) is None
    problem = low_bit_reshard_problem(_fake_metadata((256, 688), [86, 171]), model, opt)
    assert "weight (exp_avg, shape (256, 688)) in blocks of 256" in problem
    assert "row 86 falls inside a block" in problem and "subclass_8bit.py" in problem
    adamw = optim.build_optimizer(model, 1e-3, 0.1, 0.9, 0.95)
    assert low_bit_reshard_problem(_fake_metadata((256, 688), [86, 171]), model, adamw) is None


def test_low_bit_checkpoint_converts_across_parameter_layouts(tmp_path: Path, te_double) -> None:
    """hf -> te (fused QKV and gate/up, TE test double): the 8-bit moments arrive through the
    mapping table, re-quantised in the fused blocks (close, not bit for bit; said in the log),
    the lr tensors are the saved ones, and training goes on."""
    flags = ("--optimizer=adamw8bit",)
    saved = Run("hf", False, seed=1, checkpoint_dir=tmp_path / "hf", flags=flags)
    for i in range(2):
        saved.step(seed=i)
    path = saved.checkpointer.save(2, saved.state)
    loaded = Run("te", False, seed=2, checkpoint_dir=tmp_path / "te", flags=flags)
    result = loaded.checkpointer.load(path, loaded.state)
    assert result.converted_from == "hf"
    for field in ("exp_avg", "exp_avg_sq"):
        got, want = (_hf_moments(r, field) for r in (loaded, saved))
        assert set(got) == set(want)
        for name, tensor in want.items():
            scale = tensor.abs().max()
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=float(scale) * 0.02)
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [
        g["lr"] for g in saved.optimizer.param_groups
    ]
    assert all(isinstance(g["lr"], torch.Tensor) for g in loaded.optimizer.param_groups)
    assert torch.isfinite(torch.tensor(loaded.step(seed=3)))


def _hf_moments(run, field: str) -> dict[str, torch.Tensor]:
    """Dequantised moments under HF names (a world of one: the local tensor is all of it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(run.model, run.optimizer)
    return to_hf({k: dequantized(v[field]) for k, v in osd["state"].items()}, run.model.config)
