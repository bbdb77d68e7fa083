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
from model_utils.checkpoint import manifest
from model_utils.checkpoint.manifest import MARKER, checkpoint_name
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
    assert ck.read_marker(path)["format"] == manifest.CHECKPOINT_FORMAT == 2
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
        keeps = "Float8CurrentScaling" if recipe else "no TE FP8"
        assert f"FP8 scaling state of 0 TE modules restored from {path}: this run ({keeps})" in (
            caplog.text
        )
        assert te_state.fp8_scaling_state(other.model) == {}
        assert torch.isfinite(torch.tensor(other.step(seed=1)))


def test_validation_leaves_the_delayed_scaling_state_and_the_losses_alone(
    tmp_path, te_double, monkeypatch
) -> None:
    """TE keeps an inference forward's amaxes in row 0 of every history and updates nothing at
    the exit of an autocast with grad disabled; train.py's validation (run_log.evaluate) puts
    the state back, so a validation between two steps changes neither the scaling state nor the
    losses that follow (which a checkpoint taken right after it would otherwise carry)."""
    from model_utils.report.run_log import evaluate

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


def _as_format_1(path: Path) -> Path:
    """Checkpoint `path` with the marker of checkpoint format 1 (TE's pickled FP8 state)."""
    import json

    marker = ck.read_marker(path)
    (path / MARKER).write_text(json.dumps({**marker, "format": 1}))
    return path


def _refusal(path: Path) -> str:
    return (
        f"checkpoint {path} is in checkpoint format 1, which this recipe no longer loads (it "
        f"loads format 2): convert its weights with scripts/convert_checkpoint.py {path} DIR "
        "and start a new run from them with --init_from_hf DIR"
    )


def test_a_format_1_checkpoint_is_refused_in_one_line(tmp_path, te_double) -> None:
    first = Run("te", True, seed=1, checkpoint_dir=tmp_path)
    first.step(seed=0)
    path = _as_format_1(first.checkpointer.save(1, first.state))
    resumed = Run("te", True, seed=2, checkpoint_dir=tmp_path)
    with pytest.raises(ck.ResumeRefused) as err:
        resumed.checkpointer.load(path, resumed.state)
    assert str(err.value) == _refusal(path)


@pytest.mark.parametrize("saved", [3, None, 1.5, "2", True, 0])
def test_a_format_this_recipe_does_not_know_is_refused_naming_it(tmp_path, saved) -> None:
    """Not only older formats: a newer one, null, a fraction, text, a boolean are named and
    refused before anything starts, with the format this version reads."""
    import json

    from helpers.checkpoints import save_plain_checkpoints

    from model_utils.config.arguments import parse_args

    save_plain_checkpoints(tmp_path, [1])
    path = tmp_path / checkpoint_name(1)
    marker = ck.read_marker(path)
    (path / MARKER).write_text(json.dumps({**marker, "format": saved}))
    config = parse_args(["--checkpoint_dir", str(tmp_path), "--resume_from_checkpoint", str(path)])
    with pytest.raises(ck.ResumeRefused) as err:
        ck.check_before_start(config)
    assert str(err.value) == (
        f"checkpoint {path} says checkpoint format {json.dumps(saved)} in its {MARKER}, which "
        "this recipe does not load (it loads format 2): resume it with the recipe version that "
        "saved it, or start a new run"
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_format_1_checkpoint_is_refused_before_anything_starts(tmp_path) -> None:
    """The resume policy's look before any process group (train.py's validate: exit 2), for
    `auto` and for the checkpoint named by path."""
    from helpers.checkpoints import save_plain_checkpoints

    from model_utils.config.arguments import parse_args

    save_plain_checkpoints(tmp_path, [1])
    path = _as_format_1(tmp_path / checkpoint_name(1))
    for resume in ("auto", str(path)):
        config = parse_args(["--checkpoint_dir", str(tmp_path), "--resume_from_checkpoint", resume])
        with pytest.raises(ck.ResumeRefused) as err:
            ck.check_before_start(config)
        assert str(err.value) == _refusal(path)
