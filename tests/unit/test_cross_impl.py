"""Checkpoints across implementations: hf / te_linear (HF names) <-> te (fused TE layers).

A checkpoint saved by one ``--model_impl`` resumes in another: the weights and AdamW moments are
converted through te_llama's mapping table one decoder layer at a time, step, LR schedule, data
position and RNG load as usual, and TE's FP8 metadata (``_extra_state``) starts fresh. TE runs
on the TE test double (tests/te_double), which computes TE's math in pure PyTorch.

In this process (a world of one, gloo): the product's modules build the two models; the loaded
weights and moments, mapped back to HF names, equal the saved ones bit for bit; the LR is the
saved one; the loaded model's logits equal those of a plain HF ``LlamaForCausalLM`` holding the
saved weights (fp32, tight tolerance); FP8 on <-> off across implementations. train.py on 2
ranks: tests/integration/test_cross_impl_processes.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.inprocess import Run, batch

import te_llama
from model_utils.checkpoint.layout import moment_conversion_problem, param_layout

# Parameter layout of each --model_impl: te_linear keeps HF's names.
LAYOUT = {"hf": "hf", "te_linear": "hf", "te": "te"}


# ============================================================================================
# In this process


def reference_logits(weights: dict[str, torch.Tensor], config, ids: torch.Tensor) -> torch.Tensor:
    """Logits of stock transformers' Llama holding `weights` (fp32, eager attention)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{what} {name}"


CASES = [
    # (saved impl, saved fp8) -> (loaded impl, loaded fp8)
    pytest.param("hf", False, "te", False, id="hf-fp8off->te-fp8off"),
    pytest.param("te", True, "hf", False, id="te-fp8->hf-fp8off"),
    pytest.param("hf", True, "te", True, id="hf-torchao_fp8->te-fp8"),
    pytest.param("te_linear", True, "te", False, id="te_linear-fp8->te-fp8off"),
    pytest.param("hf", False, "te_linear", True, id="hf-fp8off->te_linear-fp8"),
    pytest.param("te_linear", True, "hf", False, id="te_linear-fp8->hf-fp8off"),
]


@pytest.mark.parametrize(("saved_impl", "saved_fp8", "loaded_impl", "loaded_fp8"), CASES)
def test_checkpoint_loads_across_implementations(
    saved_impl, saved_fp8, loaded_impl, loaded_fp8, tmp_path, te_double, caplog
) -> None:
    """Weights and AdamW moments arrive exactly (compared under HF names), the LR schedule
    continues, TE's FP8 metadata starts fresh, and the loaded model computes what stock HF
    computes with the saved weights."""
    saved = Run(saved_impl, saved_fp8, seed=1, checkpoint_dir=tmp_path)
    for i in range(2):
        saved.step(seed=i)
    if saved_impl != "hf" and saved_fp8:
        assert saved.extra_state_bytes() > 0  # delayed scaling history to be left behind
    path = saved.checkpointer.save(2, saved.state)

    loaded = Run(loaded_impl, loaded_fp8, seed=2, checkpoint_dir=tmp_path)
    assert not torch.equal(*(r.hf_weights()["lm_head.weight"] for r in (saved, loaded)))
    with caplog.at_level("INFO", logger="model_utils.checkpoint"):
        result = loaded.checkpointer.load(path, loaded.state)
    converted = LAYOUT[saved_impl] != LAYOUT[loaded_impl]
    assert result.converted_from == (LAYOUT[saved_impl] if converted else None)
    if converted:
        assert "converted through te_llama's mapping" in caplog.text
        assert "optimizer state (exp_avg, exp_avg_sq, step) converted" in caplog.text

    assert loaded.state.step == 2
    assert_same(loaded.hf_weights(), saved.hf_weights(), "weight")
    for field in ("exp_avg", "exp_avg_sq"):
        assert_same(loaded.hf_moments(field), saved.hf_moments(field), field)
    assert loaded.adam_steps() == saved.adam_steps() == {2.0}
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [
        g["lr"] for g in saved.optimizer.param_groups
    ]
    assert loaded.scheduler.state_dict()["last_epoch"] == saved.scheduler.state_dict()["last_epoch"]
    assert loaded.extra_state_bytes() == 0  # fresh FP8 metadata: nothing carried across

    ids = batch(seed=99)
    want = reference_logits(saved.hf_weights(), loaded.model.config, ids)
    with torch.no_grad():  # outside autocast: no FP8 rounding, FSDP2's compute dtype only
        got = loaded.model(input_ids=ids).logits.float()
    tolerance = 1e-4 if loaded.compute_dtype == torch.float32 else 3e-2  # bf16: 8 mantissa bits
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert torch.isfinite(torch.tensor(loaded.step(seed=3)))  # training goes on (FP8 if on)


def test_round_trip_hf_te_hf_is_exact_and_training_continues_identically(
    tmp_path, te_double
) -> None:
    """hf -> te -> hf through two checkpoints returns every weight and moment bit for bit; the
    te run's next step equals the hf run's next step (fp32: same data, same moments, same LR)."""
    hf = Run("hf", False, seed=1, checkpoint_dir=tmp_path / "hf")
    for i in range(2):
        hf.step(seed=i)
    first = hf.checkpointer.save(2, hf.state)

    te = Run("te", False, seed=2, checkpoint_dir=tmp_path / "te")
    te.checkpointer.load(first, te.state)
    second = te.checkpointer.save(2, te.state)
    back = Run("hf", False, seed=3, checkpoint_dir=tmp_path / "back")
    assert back.checkpointer.load(second, back.state).converted_from == "te"
    assert_same(back.hf_weights(), hf.hf_weights(), "weight")
    for field in ("exp_avg", "exp_avg_sq"):
        assert_same(back.hf_moments(field), hf.hf_moments(field), field)

    losses = {name: [run.step(seed=s) for s in (5, 6)] for name, run in (("hf", hf), ("te", te))}
    assert losses["te"] == pytest.approx(losses["hf"], rel=1e-5)
    assert losses["te"][1] != losses["te"][0]


def test_convert_script_maps_a_te_checkpoint_to_hf_exactly(tmp_path, te_double) -> None:
    """scripts/convert_checkpoint.py maps a --model_impl te checkpoint through te_llama's
    StateDictAdapter: the HF directory holds exactly the trained weights under HF names."""
    from transformers import LlamaForCausalLM

    from scripts import convert_checkpoint

    run = Run("te", False, seed=1, checkpoint_dir=tmp_path / "ck")
    run.step(seed=0)
    path = run.checkpointer.save(1, run.state)
    assert convert_checkpoint.main([str(path), str(tmp_path / "hf")]) == 0
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert_same(exported, run.hf_weights(), "converted te checkpoint")


def test_moment_conversion_problem() -> None:
    """Adam's fields convert (parameter-shaped moments, scalar step); anything else restarts."""

    class Md:
        def __init__(self, *size: int) -> None:
            self.size = torch.Size(size)

    params = {"a.weight": (4, 2), "b.weight": (3,)}

    def fields(**per_field):
        return {f: {p: ("key", md) for p, md in entry.items()} for f, entry in per_field.items()}

    adam = fields(
        exp_avg={"a.weight": Md(4, 2), "b.weight": Md(3)},
        step={"a.weight": Md(), "b.weight": Md()},
    )
    check = moment_conversion_problem
    assert check(adam, params, ["exp_avg", "step"]) is None
    assert "no optimizer state" in check({}, params, ["exp_avg"])
    assert "fields" in check(adam, params, ["exp_avg", "step", "momentum_buffer"])
    partial = fields(exp_avg={"a.weight": Md(4, 2)})
    assert "every parameter" in check(partial, params, ["exp_avg"])
    factored = fields(row={"a.weight": Md(4), "b.weight": Md(3)})
    assert "neither" in check(factored, params, ["row"])


def test_param_layout() -> None:
    assert param_layout(["model.layers.0.self_attn.q_proj.weight"]) == "hf"
    assert param_layout(["model.layers.0.self_attn.q_proj._extra_state"]) == "hf"
    te_name = "model.layers.3.transformer_layer.self_attention.layernorm_qkv.weight"
    assert param_layout(["lm_head.weight", te_name]) == "te"
    with pytest.raises(ValueError, match="no parameter mapping"):
        te_llama.StateDictAdapter(None).converter("hf", "hf")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-or-fp32", "fp8"])
def test_one_seed_is_one_starting_model_in_every_impl(fp8: bool, tmp_path, te_double) -> None:
    """--seed init draws every value from (seed, HF name), and the fused TE layout concatenates
    the HF parts by te_llama's table: hf, te_linear and te start from the same weights and give
    the same step-1 loss (FP8: te and te_linear share TE's emulated recipe; hf uses torchao)."""
    runs = {impl: Run(impl, fp8, seed=7, checkpoint_dir=tmp_path / impl) for impl in LAYOUT}
    for impl in ("te", "te_linear"):
        assert_same(runs[impl].hf_weights(), runs["hf"].hf_weights(), f"{impl} weight")
    losses = {impl: run.step(seed=0) for impl, run in runs.items()}
    tolerance = 2e-3 if fp8 else 1e-5
    assert losses["te"] == pytest.approx(losses["te_linear"], rel=tolerance)
    assert losses["te"] == pytest.approx(losses["hf"], rel=2e-2 if fp8 else tolerance)
    other_seed = Run("te", fp8, seed=8, checkpoint_dir=tmp_path / "other")
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(other_seed.hf_weights()[up], runs["te"].hf_weights()[up])


def test_master_weights_convert_across_layouts_like_the_moments(tmp_path, te_double) -> None:
    """--master_weights optimizer keeps an fp32 ``master_param`` per parameter, shaped like it:
    hf -> te -> hf through two checkpoints returns every master and moment bit for bit (the
    fused qkv / fc1 concatenations split back exactly), the bf16 weights too, and the run goes
    on in the te layout with its masters."""
    flags = ("--master_weights=optimizer",)
    hf = Run("hf", True, seed=1, checkpoint_dir=tmp_path / "hf", flags=flags)
    for i in range(2):
        hf.step(seed=i)
    first = hf.checkpointer.save(2, hf.state)
    te = Run("te", True, seed=2, checkpoint_dir=tmp_path / "te", flags=flags)
    assert te.checkpointer.load(first, te.state).converted_from == "hf"
    second = te.checkpointer.save(2, te.state)
    back = Run("hf", True, seed=3, checkpoint_dir=tmp_path / "back", flags=flags)
    back.checkpointer.load(second, back.state)
    assert_same(back.hf_weights(), hf.hf_weights(), "weight")
    for field in ("exp_avg", "exp_avg_sq", "master_param"):
        assert_same(back.hf_moments(field), hf.hf_moments(field), field)
    masters = back.hf_moments("master_param")
    weights = back.hf_weights()
    assert all(torch.equal(masters[k].to(torch.bfloat16).float(), weights[k]) for k in weights)
    assert torch.isfinite(torch.tensor(te.step(seed=5)))
