"""``--fp8_attention``: TE's FP8 fused attention (the recipe's ``fp8_dpa``), on the TE double.

What TE 2.20 does, read from its source and mirrored by the double: only cuDNN's FusedAttention
runs FP8 attention in training; on Hopper it needs delayed scaling and head_dim 128, current
scaling needs SM 10.0+, Float8BlockScaling has none (its recipe asserts). Where TE would find
no backend it raises at the first forward, after the launch; train.py refuses before it.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.inprocess import Run

from model_utils.config.arguments import UsageError, parse_args
from model_utils.precision import te as te_precision
from model_utils.precision import te_requirements, te_state
from model_utils.precision.te import TEBackend
from model_utils.precision.te_requirements import TECapabilityError

#: head_dim 128 (256 / 2): the width cuDNN's FP8 attention takes on Hopper.
HEAD_128 = ("--hidden_width", "256", "--num_heads", "2", "--num_key_value_heads", "2")
TE_FP8 = ("--model_impl", "te", "--fp8=1")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--model_impl", "te", "--fp8=0"), "--fp8_attention needs --fp8=1"),
        (("--model_impl", "hf", "--fp8=1"), "TE's fused attention .*: it needs --model_impl te$"),
        (("--model_impl", "te_linear", "--fp8=1"), "te_linear and hf keep HF's\\): it needs"),
        ((*TE_FP8, "--fp8_recipe", "block"), "no FP8 attention path with --fp8_recipe block"),
        ((*TE_FP8, "--fp8_recipe", "mxfp8"), "use --fp8_recipe delayed or current"),
    ],
    ids=["no-fp8", "hf", "te_linear", "block", "mxfp8"],
)
def test_flag_combinations_without_an_fp8_attention_path_are_refused(
    flags, message, te_double
) -> None:
    with pytest.raises(UsageError, match=message):
        parse_args([*flags, "--fp8_attention"])


@pytest.mark.parametrize(
    ("recipe", "sm", "head_dim", "expected"),
    [
        ("delayed", (9, 0), 128, None),
        ("delayed", (9, 0), 64, "needs head_dim 128 .*this model has 64"),
        ("current", (9, 0), 128, "needs SM 10.0\\+ .*on Hopper use --fp8_recipe delayed"),
        ("delayed", (8, 9), 128, "SM 9.0\\+ \\(Hopper\\); this GPU is SM 8.9"),
        ("current", (10, 0), 64, None),
        ("delayed", (10, 0), 64, None),
        ("current", (10, 0), 128, None),
        ("current", (10, 0), 256, "at most 128 and a multiple of 16 .*this model has 256"),
        ("delayed", (10, 3), 72, "at most 128 and a multiple of 16 .*this model has 72"),
        ("delayed", (12, 0), 128, "TE has no FP8 attention on SM 12.0"),
    ],
)
def test_where_te_has_an_fp8_attention_backend(recipe, sm, head_dim, expected) -> None:
    problem = te_requirements.fp8_attention_problem(recipe, sm=sm, head_dim=head_dim)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert re.search(expected, problem), problem


def test_deterministic_fp8_attention_needs_cudnn_9_19() -> None:
    """TE disables its FP8 attention for determinism below cuDNN 9.19 (the GPU tier sets
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, so it meets this rule first)."""
    rule = te_requirements.fp8_attention_problem
    old = rule("delayed", sm=(9, 0), head_dim=128, deterministic=True, cudnn=(9, 10, 2))
    assert old and "needs cuDNN >= 9.19.0, found 9.10.2" in old
    assert rule("delayed", sm=(9, 0), head_dim=128, deterministic=True, cudnn=(9, 19, 0)) is None
    assert rule("delayed", sm=(9, 0), head_dim=128, deterministic=False, cudnn=(9, 10, 2)) is None


def test_the_recipe_carries_fp8_dpa(te_double) -> None:
    assert te_precision.build_recipe("delayed", fp8_attention=True).fp8_dpa is True
    assert te_precision.build_recipe("current", fp8_attention=True).fp8_dpa is True
    assert te_precision.build_recipe("delayed").fp8_dpa is False
    # Block scaling has no FP8 attention path: start-up refuses the pair (the "block" case
    # above), and its recipe is never given the option.
    assert not te_precision.build_recipe("block", fp8_attention=True).fp8_dpa


def _backend(recipe: str, head_dim: int) -> TEBackend:
    args = parse_args(
        [*TE_FP8, "--fp8_recipe", recipe, "--fp8_attention"]
        + ["--hidden_width", str(2 * head_dim), "--num_heads", "2", "--num_key_value_heads", "2"]
    )
    return TEBackend(args)


def test_capability_check_refuses_what_te_would_fail_on_after_the_launch(
    te_double, monkeypatch
) -> None:
    with pytest.raises(TECapabilityError, match="needs head_dim 128"):
        _backend("delayed", head_dim=32).capability_check()
    with pytest.raises(TECapabilityError, match="current needs SM 10.0"):
        _backend("current", head_dim=128).capability_check()
    _backend("delayed", head_dim=128).capability_check()
    monkeypatch.setenv("TE_DOUBLE_SM", "10.0")
    _backend("current", head_dim=32).capability_check()
    with pytest.raises(TECapabilityError, match="at most 128 and a multiple of 16"):
        _backend("current", head_dim=40).capability_check()
    monkeypatch.setenv("TE_DOUBLE_SM", "12.0")
    with pytest.raises(TECapabilityError, match="no FP8 attention on SM 12.0"):
        _backend("delayed", head_dim=128).capability_check()


def test_the_cudnn_rule_reads_the_cudnn_te_loaded(te_double, monkeypatch) -> None:
    """On an H100 torch's ``cudnn.version()`` raised (torch built on 9.19, TE had loaded 9.14),
    so the check asks TE, whose attention backend choice reads the same number."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setenv("TE_DOUBLE_CUDNN", "9.14.0")
    assert te_precision.cudnn_version() == (9, 14, 0)
    with pytest.raises(TECapabilityError, match="needs cuDNN >= 9.19.0, found 9.14.0"):
        _backend("delayed", head_dim=128).capability_check()
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    _backend("delayed", head_dim=128).capability_check()
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setenv("TE_DOUBLE_CUDNN", "9.19.0")
    _backend("delayed", head_dim=128).capability_check()


@pytest.mark.parametrize(
    ("sm", "head_dim", "says"),
    [
        ("12.0", 128, "not supported for sm120"),
        ("10.0", 40, "head_dim <= 128, % 16 == 0"),
        ("10.0", 64, None),
    ],
)
def test_the_double_has_no_fp8_attention_where_te_has_none(
    sm, head_dim, says, te_double, monkeypatch
) -> None:
    """The double refuses what TE's backend choice finds no FP8 attention for (SM 12.0; on SM
    10.0+ a head_dim over 128 or not a multiple of 16), as the plan's rule above does first."""
    import transformer_engine.pytorch as te

    monkeypatch.setenv("TE_DOUBLE_SM", sm)
    attention, recipe = te._DotProductAttention(), te_precision.build_recipe("current")
    if says is None:
        attention.check_fp8_backend(recipe, head_dim)
        return
    with pytest.raises(ValueError, match=re.escape(says)):
        attention.check_fp8_backend(recipe, head_dim)


def test_without_the_check_te_fails_at_the_first_forward(tmp_path, te_double) -> None:
    """Why train.py checks first: TE (here its double) raises inside the first forward."""
    run = Run("te", True, seed=0, checkpoint_dir=tmp_path)  # head_dim 16, no --fp8_attention
    recipe = te_precision.build_recipe("delayed", amax_history_len=4, fp8_attention=True)
    run.backend._recipe = recipe
    with pytest.raises(ValueError, match="No dot product attention backend is available"):
        run.step(seed=0)


def _attention_amax(model: torch.nn.Module) -> float:
    """The largest amax the attention modules recorded (their history, every slot)."""
    return max(
        float(module.fp8_meta["scaling_fwd"].amax_history.abs().max())
        for name, module in model.named_modules()
        if name.endswith("core_attention")
    )


def test_fp8_attention_trains_close_to_fp8_gemms_alone(tmp_path, te_double) -> None:
    """Same seed and batches: FP8 attention changes the numbers (the attention modules record
    amaxes), and the losses stay within 2% of FP8 GEMMs alone, finite and falling."""
    runs = {
        flag: Run("te", True, seed=0, checkpoint_dir=tmp_path / str(flag), flags=(*HEAD_128, *f))
        for flag, f in ((False, ()), (True, ("--fp8_attention",)))
    }
    losses = {flag: [run.step(seed=i % 2) for i in range(6)] for flag, run in runs.items()}
    assert _attention_amax(runs[False].model) == 0.0
    assert _attention_amax(runs[True].model) > 0.0
    assert losses[True] != losses[False]
    assert all(torch.isfinite(torch.tensor(losses[True])))
    assert losses[True][-1] < losses[True][0]
    for on, off in zip(losses[True], losses[False], strict=True):
        assert abs(on - off) / off < 0.02


@pytest.mark.parametrize(("recipe", "sm"), [("delayed", "9.0"), ("current", "10.0")])
def test_resume_with_fp8_attention_is_bit_for_bit(
    recipe, sm, tmp_path, te_double, monkeypatch, caplog
) -> None:
    """The attention's delayed-scaling state is saved with the others and restored. Under
    current scaling (SM 10.0+) TE keeps such state only for S and dP, on a delayed recipe of the
    attention's own (one GEMM's slots): the resume restores it although the run's recipe keeps
    none, and the next steps match the uninterrupted run's."""
    monkeypatch.setenv("TE_DOUBLE_SM", sm)
    flags = (*HEAD_128, "--fp8_attention")
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path, recipe=recipe, flags=flags)
    for i in range(3):
        first.step(seed=i)
    path = first.checkpointer.save(3, first.state)
    saved = te_state.fp8_scaling_state(first.model)
    attention = [k for k in saved if "core_attention" in k and k.endswith("scale_fwd")]
    assert attention and all((saved[k] != 1).any() for k in attention)  # scales were updated
    assert all(saved[k].numel() == (9 if recipe == "delayed" else 3) for k in attention)
    want = [first.step(seed=i) for i in range(3, 6)]
    resumed = Run("te", True, seed=2, checkpoint_dir=tmp_path, recipe=recipe, flags=flags)
    with caplog.at_level("INFO"):
        resumed.checkpointer.load(path, resumed.state)
    restored = len(attention) if recipe == "current" else len(saved) // 5
    assert f"FP8 scaling state of {restored} TE modules restored" in caplog.text
    assert [resumed.step(seed=i) for i in range(3, 6)] == want


def test_train_py_refuses_before_starting(refused_by_train, te_double) -> None:
    """tiny's head_dim is 64: on the (emulated) H100 the run stops in one line, exit 2."""
    _, errors, _ = refused_by_train(*TE_FP8, "--fp8_attention")
    assert errors == [
        "train.py: error: --fp8_attention on SM 9.x needs head_dim 128 (cuDNN's FP8 attention); "
        "this model has 64 (hidden_width / num_heads)"
    ]


def test_activation_checkpointing_replays_fp8_attention(tmp_path, te_double) -> None:
    """Recomputing a layer in backward must quantize attention with the forward's scales (delayed
    scaling updates them when the forward's autocast exits, before backward runs): the same
    losses with and without --activation_checkpointing. ``most_recent``: the recompute's own
    autocast rolls the forward histories once more (next test), which moves a ``max`` over a
    4-row history but not the most recent amax."""
    losses = {}
    for ac in (False, True):
        flags = (*HEAD_128, "--fp8_attention", "--amax_compute_algo=most_recent")
        flags += ("--activation_checkpointing",) if ac else ()
        run = Run("te", True, seed=0, checkpoint_dir=tmp_path / str(ac), flags=flags)
        losses[ac] = [run.step(seed=i % 2) for i in range(4)]
    assert losses[True] == losses[False]


@pytest.mark.parametrize("scope", ["layer", "mlp"])
def test_whole_layer_recompute_rolls_the_forward_histories_once_per_layer(
    scope, tmp_path, te_double
) -> None:
    """TE's ``checkpoint`` recomputes a layer inside an autocast of its own, whose exit updates the
    forward scaling state like the forward's (test_te_contract): with whole-layer
    --activation_checkpointing a step rolls every forward amax history 1 + (recomputed layers)
    times, so --amax_history_len counts forward passes and recomputes (docs/architecture.md).
    Backward histories roll once per backward; the fused MLP's own recompute opens no autocast."""
    layers = 2
    positions = {}
    for ac in (False, True):
        flags = ("--amax_history_len=8",)
        flags += ("--activation_checkpointing", f"--ac_scope={scope}") if ac else ()
        run = Run("te", True, seed=0, checkpoint_dir=tmp_path / str(ac), flags=flags)
        run.step(seed=0)
        state = te_state.fp8_scaling_state(run.model)
        positions[ac] = {
            direction: {
                int(state[k].abs().sum(1).nonzero().flatten().item())
                for k in state
                if k.endswith(f"amax_history_{direction}") and state[k].any()
            }
            for direction in ("fwd", "bwd")
        }
    rolls = layers if scope == "layer" else 0
    assert positions[False] == {"fwd": {7}, "bwd": {7}}  # row 7: the step's amax, rolled once
    assert positions[True] == {"fwd": {7 - rolls}, "bwd": {7}}
