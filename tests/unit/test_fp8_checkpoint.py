"""TE's FP8 scaling state in checkpoints: plain tensors, never a pickle, on every TE release.

TE >= 2.18 refuses to unpickle delayed-scaling ``_extra_state`` unless the user sets
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (seen on an H100 with TE 2.20.2). The checkpoint
therefore stores each TE module's scales and amax histories as plain tensors (format 2) and
leaves ``_extra_state`` out. The TE test double applies TE 2.20.2's refusal (and TE 2.16's
acceptance with ``TE_DOUBLE_VERSION=2.16.0``), so these tests would have caught the defect.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.inprocess import Run, batch

from model_utils import checkpoint as ck
from model_utils.checkpoint import checkpointer, stateful
from model_utils.checkpoint.errors import TE_UNSAFE_PICKLE_ENV, pickled_fp8_state_problem
from model_utils.checkpoint.manifest import DCP_METADATA, MARKER, checkpoint_name
from model_utils.precision import te_state

RECIPES = ["delayed", "current", "block", "mxfp8"]


def _saved_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _fp8_state(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in te_state.fp8_scaling_state(run.model).items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_is_bit_for_bit_for_every_recipe(recipe, tmp_path, te_double, monkeypatch) -> None:
    """Save after 3 FP8 steps, go on to 6; a fresh model loading the checkpoint repeats steps
    4-6 bit for bit. Nothing in the checkpoint is a pickle of TE's."""
    if recipe == "mxfp8":
        monkeypatch.setenv("TE_DOUBLE_SM", "10.0")
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path, recipe=recipe)
    for i in range(3):
        first.step(seed=i)
    path = first.checkpointer.save(3, first.state)
    saved_fp8 = _fp8_state(first)
    want = [first.step(seed=i) for i in range(3, 6)]

    keys = _saved_keys(path)
    assert not [k for k in keys if k.endswith("_extra_state")]
    assert ck.read_marker(path)["format"] == checkpointer.CHECKPOINT_FORMAT == 2
    assert bool([k for k in keys if k.startswith("fp8_scaling.")]) == (recipe == "delayed")

    resumed = Run("te", True, seed=2, checkpoint_dir=tmp_path, recipe=recipe)
    resumed.checkpointer.load(path, resumed.state)
    restored = _fp8_state(resumed)
    assert set(restored) == set(saved_fp8)
    for key, tensor in saved_fp8.items():
        assert torch.equal(restored[key], tensor), key
    assert [resumed.step(seed=i) for i in range(3, 6)] == want


def test_delayed_state_holds_every_module_and_the_recipe(tmp_path, te_double) -> None:
    run = Run("te", True, seed=1, checkpoint_dir=tmp_path)
    run.step(seed=0)
    state = te_state.fp8_scaling_state(run.model)
    layers = run.model.config.num_hidden_layers
    recipes = [k for k in state if k.endswith(".recipe")]
    # qkv, proj, the MLP and core attention of every layer (TE allocates the attention's state
    # under any FP8 autocast; --fp8_attention fills it)
    assert len(recipes) == 4 * layers
    identity = te_state.decode_recipe_identity(state[recipes[0]])
    assert identity == {
        "class": "DelayedScaling",
        "fp8_format": "HYBRID",
        "amax_history_len": 4,
        "amax_compute_algo": "max",
        "margin": 0,
    }
    mlp = "model.layers.0.transformer_layer.layernorm_mlp."
    assert state[mlp + "scale_fwd"].shape == (3 * 2,)  # 3 tensors per GEMM forward, 2 GEMMs
    assert state[mlp + "amax_history_bwd"].shape == (4, 2 * 2)
    assert state[mlp + "amax_history_fwd"].abs().sum() > 0  # FP8 ran: amaxes were recorded


def test_delayed_state_is_left_out_when_the_resumed_run_uses_another_recipe(
    tmp_path, te_double, caplog
) -> None:
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path)
    first.step(seed=0)
    path = first.checkpointer.save(1, first.state)
    for recipe in ("current", None):
        other = Run("te", recipe is not None, seed=2, checkpoint_dir=tmp_path, recipe=recipe or "")
        with caplog.at_level("INFO", logger="model_utils.checkpoint"):
            other.checkpointer.load(path, other.state)
        assert "holds FP8 delayed-scaling state (DelayedScaling)" in caplog.text
        assert te_state.fp8_scaling_state(other.model) == {}
        assert torch.isfinite(torch.tensor(other.step(seed=1)))


def test_validation_leaves_the_delayed_scaling_state_and_the_losses_alone(
    tmp_path, te_double, monkeypatch
) -> None:
    """TE keeps an inference forward's amaxes in row 0 of every history and updates nothing at
    the exit of an autocast with grad disabled; train.py's validation (run_log.evaluate) puts
    the state back, so a validation between two steps changes neither the scaling state nor the
    losses that follow (which a checkpoint taken right after it would otherwise carry)."""
    from model_utils.run.run_log import evaluate

    held_out = [{"input_ids": ids, "labels": ids} for ids in (3 * batch(7) % 8192, batch(8))]

    def run_with(validate: bool) -> tuple[list[float], bool]:
        """Six steps' losses, validating after the second; whether the state came back."""
        run = Run("te", True, seed=1, checkpoint_dir=tmp_path / str(validate))
        out = [run.step(seed=i) for i in range(2)]
        before = _fp8_state(run)
        if validate:
            assert torch.isfinite(torch.tensor(evaluate(run.model, held_out, run.backend, "cpu")))
        after = _fp8_state(run)
        kept = after.keys() == before.keys() and all(
            torch.equal(after[k], before[k]) for k in before
        )
        return out + [run.step(seed=i) for i in range(2, 6)], kept

    plain, _ = run_with(validate=False)
    assert run_with(validate=True) == (plain, True)
    from model_utils.precision import te as te_precision

    monkeypatch.setattr(te_precision, "fp8_scaling_kept", lambda model: contextlib.nullcontext())
    validated, kept = run_with(validate=True)  # what TE alone gives
    assert not kept and validated[:2] == plain[:2] and validated[2:] != plain[2:]


def _save_format_1(run: Run, step: int, monkeypatch) -> Path:
    """A checkpoint as this recipe wrote it before format 2: TE's pickles as bytes."""
    with monkeypatch.context() as patch:
        patch.setattr(checkpointer, "CHECKPOINT_FORMAT", 1)
        patch.setattr(stateful.ModelItem, "__init__", _legacy_init)
        patch.setattr(stateful.Fp8ScalingItem, "state_dict", lambda self: {})
        return run.checkpointer.save(step, run.state)


_modern_init = stateful.ModelItem.__init__


def _legacy_init(self, model, legacy=False, absent_extra_state=()):
    _modern_init(self, model, legacy=True, absent_extra_state=absent_extra_state)


def test_format_1_checkpoint_is_refused_in_one_line_by_te_2_20(
    tmp_path, te_double, monkeypatch
) -> None:
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path)
    for i in range(2):
        first.step(seed=i)
    path = _save_format_1(first, 2, monkeypatch)
    assert [k for k in _saved_keys(path) if k.endswith("_extra_state")]
    want = [first.step(seed=i) for i in (2, 3)]

    refused = Run("te", True, seed=2, checkpoint_dir=tmp_path)
    with pytest.raises(ck.UntrustedCheckpointError, match=TE_UNSAFE_PICKLE_ENV) as err:
        refused.checkpointer.load(path, refused.state)
    assert "\n" not in str(err.value)

    monkeypatch.setenv(TE_UNSAFE_PICKLE_ENV, "1")  # the user's trust decision, not ours
    trusted = Run("te", True, seed=2, checkpoint_dir=tmp_path)
    trusted.checkpointer.load(path, trusted.state)
    assert [trusted.step(seed=i) for i in (2, 3)] == want
    resaved = trusted.checkpointer.save(4, trusted.state)
    assert not [k for k in _saved_keys(resaved) if k.endswith("_extra_state")]


def test_format_1_checkpoint_loads_where_te_accepts_it(tmp_path, te_double, monkeypatch) -> None:
    monkeypatch.setenv("TE_DOUBLE_VERSION", "2.16.0")  # the image's TE: no refusal yet
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path)
    first.step(seed=0)
    path = _save_format_1(first, 1, monkeypatch)
    want = first.step(seed=1)
    resumed = Run("te", True, seed=2, checkpoint_dir=tmp_path)
    resumed.checkpointer.load(path, resumed.state)
    assert resumed.step(seed=1) == want


def test_preflight_names_the_variable_before_anything_starts(tmp_path) -> None:
    marker = {
        "format": 1,
        "run_config": {"model_impl": "te", "fp8": True, "fp8_recipe": "delayed"},
    }
    problem = pickled_fp8_state_problem(tmp_path, marker, "2.20.2", env={})
    assert problem is not None and TE_UNSAFE_PICKLE_ENV in problem and str(tmp_path) in problem
    assert "trust" in problem and "\n" not in problem
    ok = pickled_fp8_state_problem
    assert ok(tmp_path, marker, "2.16.0", env={}) is None  # TE 2.16 unpickles it
    assert ok(tmp_path, marker, "2.20.2", env={TE_UNSAFE_PICKLE_ENV: "1"}) is None
    assert ok(tmp_path, {**marker, "format": 2}, "2.20.2", env={}) is None
    current = {**marker, "run_config": {**marker["run_config"], "fp8_recipe": "current"}}
    assert ok(tmp_path, current, "2.20.2", env={}) is None  # stateless: TE ignores its payload
    assert ok(tmp_path, {**marker, "run_config": {"model_impl": "hf"}}, "2.20.2", env={}) is None


def test_preflight_reads_the_checkpoint_a_resume_would_take(tmp_path) -> None:
    """checkpoint.check_fp8_state_loadable, which train.py's validate() runs for the TE
    implementations: the newest complete checkpoint (``auto``) or the one named, refused in one
    line (UsageError: exit 2) when this TE would refuse its pickled FP8 state."""
    import json

    from model_utils.config.arguments import parse_args
    from model_utils.errors import UsageError

    def resuming(resume: str | None):
        flags = ["--checkpoint_dir", str(tmp_path)]
        return parse_args([*flags, *(["--resume_from_checkpoint", resume] if resume else [])])

    saved = tmp_path / checkpoint_name(2)
    saved.mkdir()
    (saved / DCP_METADATA).write_bytes(b"")
    run_config = {"model_impl": "te", "fp8": True, "fp8_recipe": "delayed"}
    (saved / MARKER).write_text(json.dumps({"format": 1, "run_config": run_config}))
    for resume in ("auto", str(saved)):
        args = resuming(resume).checkpoint
        with pytest.raises(UsageError, match=TE_UNSAFE_PICKLE_ENV) as err:
            ck.check_fp8_state_loadable(args, "2.20.2")
        assert str(saved) in str(err.value) and "\n" not in str(err.value)
        ck.check_fp8_state_loadable(args, "2.16.0")  # TE 2.16 unpickles it
    fresh = resuming(None).checkpoint
    ck.check_fp8_state_loadable(fresh, "2.20.2")  # no resume: nothing to read
