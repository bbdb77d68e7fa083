"""Checkpoints in this process: which checkpoint resumes, keep-last's plan, HF directories and
round trips on a plain model, a world of one, the safetensors shard writer and the converter's
refusal. The multi-rank behaviour is in tests/integration/test_checkpoint_processes.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.checkpoints import TINY, differences, logits

from model_utils import checkpoint as ck
from model_utils.checkpoint.hf import HF_INDEX, HF_SINGLE, SafetensorsShardWriter, existing_model
from model_utils.checkpoint.layout import layer_groups
from model_utils.checkpoint.manifest import (
    DCP_METADATA,
    MARKER,
    UNVERIFIED,
    checkpoint_name,
    latest_checkpoint,
    prune_plan,
    step_of,
)
from model_utils.checkpoint.resume import (
    check_fresh_start,
    check_resume_target,
    check_steps_left,
)

REPO = Path(__file__).resolve().parents[2]


# -- pure filesystem rules --------------------------------------------------------------------


def _fake_checkpoint(root: Path, name: str, marker: bool = True, metadata: bool = True) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if metadata:
        (path / DCP_METADATA).write_bytes(b"x")
    if marker:
        (path / MARKER).write_text(json.dumps({"step": step_of(path), "world_size": 1}))
    return path


def test_auto_resume_picks_newest_complete(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, "step_00000001")
    newest = _fake_checkpoint(tmp_path, "step_00000020")
    _fake_checkpoint(tmp_path, "step_00000100", marker=False)  # crashed before publish
    _fake_checkpoint(tmp_path, ".tmp-step_00000200")
    _fake_checkpoint(tmp_path, ".tmp-step_00000020.replaced")  # a save that replaced step 20
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / ".tmp-mine").mkdir()  # a user's: no save of the recipe made it
    (tmp_path / ".tmp-step_mine").mkdir()
    assert latest_checkpoint(tmp_path) == newest
    assert ck.Checkpointer(tmp_path).latest() == newest
    assert ck.checkpoint_to_resume(None, tmp_path) is None
    assert ck.checkpoint_to_resume("auto", tmp_path / "missing") is None  # fresh start
    with pytest.raises(ValueError, match=f"is a folder of checkpoints, not one: .*{newest}"):
        ck.check_resume_arg(str(tmp_path))  # was "has no .metadata: not a DCP ..."
    assert not (tmp_path / ".tmp-step_00000200").exists()  # cleaned by the Checkpointer
    assert not (tmp_path / ".tmp-step_00000020.replaced").exists()
    assert (tmp_path / ".tmp-mine").is_dir() and (tmp_path / ".tmp-step_mine").is_dir()


def test_a_run_folder_given_as_the_checkpoint_names_its_newest(tmp_path: Path) -> None:
    """It said "has no .metadata: not a DCP checkpoint", with no word of checkpoints/."""
    (tmp_path / "checkpoints").mkdir()
    newest = _fake_checkpoint(tmp_path / "checkpoints", "step_00000020")
    with pytest.raises(ValueError) as refused:
        ck.check_resume_arg(str(tmp_path))
    assert str(refused.value) == (
        f"--resume_from_checkpoint: {tmp_path} is a folder of checkpoints, not one: give one of "
        f"them (newest: {newest}), "
        f"or --resume_from_checkpoint auto with --checkpoint_dir {tmp_path / 'checkpoints'}"
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("files", [{"__0_0.distcp": 5}, ["__0_0.distcp"], {"x": {"bytes": "5"}}])
def test_a_malformed_file_list_is_unverified_not_a_traceback(tmp_path: Path, files: Any) -> None:
    import torch.distributed.checkpoint as dcp

    path = _fake_checkpoint(tmp_path, "step_00000001", metadata=False)
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=path)
    assert ck.inspect_checkpoint(path).kind == UNVERIFIED  # sound, without checksums
    (path / MARKER).write_text(json.dumps({"step": 1, "files": files}))
    problem = ck.inspect_checkpoint(path)  # loadable: nothing is missing or cut short
    assert problem.kind == UNVERIFIED and problem.why.startswith(f"{path / MARKER} records ")


def test_a_resume_never_writes_over_checkpoints_it_did_not_start_from(tmp_path: Path) -> None:
    """A resume saves into its --checkpoint_dir from the resumed step on and prunes there: it
    used to replace another run's checkpoints, or its own later ones, without a word."""
    own, other = tmp_path / "own", tmp_path / "other"
    step2, step4 = (_fake_checkpoint(own, f"step_0000000{n}") for n in (2, 4))
    elsewhere = _fake_checkpoint(other, "step_00000003")
    check_resume_target(step4, own, explicit=True)  # the newest: nothing later to lose
    check_resume_target(elsewhere, tmp_path / "empty", explicit=True)  # a new folder
    check_resume_target(step2, own, explicit=False)  # auto skipped a damaged step 4
    with pytest.raises(ck.ResumeRefused) as later:
        check_resume_target(step2, own, explicit=True)
    assert str(later.value) == (
        f"--resume_from_checkpoint {step2} (step 2) is older than 1 checkpoint(s) in {own} "
        "(newest: step 4), which this run would overwrite and prune from step 3 on: continue "
        f"from the newest with --resume_from_checkpoint auto, or move the later ones out of "
        f"{own} to go back to step 2"
    )
    with pytest.raises(ck.ResumeRefused, match="of its own run \\(newest: step 4\\)"):
        check_resume_target(elsewhere, own, explicit=True)
    check_steps_left(step4, max_steps=4)  # a finished run resubmitted: ends at once
    with pytest.raises(ck.ResumeRefused) as past:
        check_steps_left(step4, max_steps=3)
    assert str(past.value) == (  # the way to a new run named too (README's try, then a recipe)
        f"checkpoint {step4} is at step 4, past --max_steps 3: raise --max_steps to train on, "
        "export it with scripts/convert_checkpoint.py, or start a new run in another folder "
        "(RUN_NAME=NAME with 1.train_llama.sbatch, --output_dir DIR with train.py)"
    )
    with pytest.raises(ck.ResumeRefused) as earlier:
        check_fresh_start(own, overwrite=False)
    assert "start a new run in another folder (RUN_NAME=NAME with 1.train_llama" in str(
        earlier.value
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_train_refuses_a_resume_over_another_runs_checkpoints(
    tmp_path: Path, refused_by_train
) -> None:
    import torch.distributed.checkpoint as dcp

    own = _fake_checkpoint(tmp_path / "run" / "checkpoints", "step_00000004")
    elsewhere = _fake_checkpoint(tmp_path / "other", "step_00000003", metadata=False)
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=elsewhere)  # a readable .metadata
    _, lines, _ = refused_by_train(
        f"--output_dir={own.parent.parent}", f"--resume_from_checkpoint={elsewhere}"
    )
    assert len(lines) == 1 and "would overwrite and prune: start a new run in another" in lines[0]


@pytest.mark.parametrize("flag", ["output_dir", "checkpoint_dir"])
def test_a_path_through_a_missing_folder_never_reaches_a_finished_run(
    tmp_path: Path, refused_by_train, flag: str
) -> None:
    """`RUNS/missing/../done` names no folder until `missing` exists, so the fresh-start check
    saw no checkpoints; the run then created `missing` and wrote into `done`, replacing its
    step-4 checkpoint. The path is resolved where it is read, and the check finds them."""
    done = tmp_path / "done"
    _fake_checkpoint(done / "checkpoints", "step_00000004")
    trick = tmp_path / "missing" / ".." / "done"
    value = trick if flag == "output_dir" else trick / "checkpoints"
    _, lines, _ = refused_by_train(f"--{flag}={value}")
    assert len(lines) == 1 and "start a new run in another folder" in lines[0], lines
    assert str(done) in lines[0] and not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    ("name", "marker", "metadata", "message"),
    [
        ("step_00000005", False, True, "never completed"),
        ("step_00000006", True, False, "no .metadata"),
        (".tmp-step_00000007", True, True, "unfinished save"),
        ("absent", None, None, "does not exist"),
    ],
)
def test_explicit_resume_path_must_be_complete(
    tmp_path: Path, name: str, marker: bool | None, metadata: bool | None, message: str
) -> None:
    if marker is not None:
        _fake_checkpoint(tmp_path, name, marker=marker, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        ck.check_resume_arg(str(tmp_path / name))
    with pytest.raises(ValueError, match="--resume_from_checkpoint"):
        ck.checkpoint_to_resume(str(tmp_path / name), tmp_path, verify=False)


def test_prune_plan_keeps_newest_and_the_one_just_published() -> None:
    paths = [Path(checkpoint_name(s)) for s in (1, 2, 3, 4)]
    assert prune_plan(paths, 2, paths[-1]) == paths[:2]
    assert prune_plan(paths, None, paths[-1]) == []
    assert prune_plan(paths, 1, paths[1]) == [paths[0], paths[2], paths[3]]
    assert prune_plan(paths[:1], 3, paths[0]) == []


def test_layer_groups_and_the_adapter_layer_by_layer_match_whole_model_mapping() -> None:
    names = [
        "lm_head.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "model.norm.weight",
        "model.layers.2.mlp.up_proj.weight",
    ]
    assert layer_groups(names) == [
        ["lm_head.weight", "model.norm.weight"],
        ["model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.up_proj.weight"],
        ["model.layers.10.mlp.up_proj.weight"],
    ]
    te_llama = pytest.importorskip("te_llama")
    from transformers import LlamaForCausalLM

    from model_utils.config import arguments
    from model_utils.model import modeling

    config = modeling.model_config(arguments.parse_args([*TINY, "--num_layers", "3"]).model)
    hf = LlamaForCausalLM(config).state_dict()
    adapter = te_llama.StateDictAdapter(config)
    whole = adapter.from_hf(hf)
    to_te, to_hf = adapter.from_hf, adapter.to_hf
    by_layer: dict[str, torch.Tensor] = {}
    for group in layer_groups(hf):
        by_layer.update(to_te({n: hf[n] for n in group}))
    assert differences(by_layer, whole) == []
    back: dict[str, torch.Tensor] = {}
    for group in layer_groups(by_layer):
        back.update(to_hf({n: by_layer[n] for n in group}))
    assert differences(back, dict(hf)) == []


def test_hf_dir_errors_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ck.check_hf_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        ck.check_hf_dir(tmp_path)
    (tmp_path / HF_INDEX).write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="missing shard"):
        ck.check_hf_dir(tmp_path)


def test_hf_in_and_out_on_a_plain_tied_model(tmp_path: Path) -> None:
    """No process group, no FSDP: tied embeddings (no lm_head in the file, like Llama 3.2) load,
    export writes the tied weight once, and a shape mismatch is a clear error."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    from model_utils import data
    from model_utils.config import arguments
    from model_utils.config.presets import BUNDLED_TOKENIZER
    from model_utils.model import modeling

    config = modeling.model_config(arguments.parse_args(TINY).model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    source = LlamaForCausalLM(config)
    source.save_pretrained(tmp_path / "src")
    target = LlamaForCausalLM(config)
    ck.load_hf_weights(target, tmp_path / "src")
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert differences(dict(target.state_dict()), dict(source.state_dict())) == []
    ck.export_hf(target, config, tmp_path / "out", data.load_tokenizer(BUNDLED_TOKENIZER))
    with safe_open(str(tmp_path / "out" / HF_SINGLE), "pt") as fh:
        assert "lm_head.weight" not in fh.keys()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(logits(reloaded), logits(source))
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="missing.*model.layers.2"):
        ck.load_hf_weights(LlamaForCausalLM(config), tmp_path / "src")
    config.num_hidden_layers, config.hidden_size = 2, 128
    with pytest.raises(ValueError, match="has shape .* but the model expects"):
        ck.load_hf_weights(LlamaForCausalLM(config), tmp_path / "src")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_without_a_process_group_and_a_repeated_step(tmp_path: Path) -> None:
    """One process without a process group saves and loads; saving a step again is skipped.
    (TE's pickled ``_extra_state`` is never saved: tests/unit/test_fp8_checkpoint.py.)"""
    saved = torch.nn.Sequential(torch.nn.Linear(16, 16))
    ckpt = ck.Checkpointer(tmp_path)
    path = ckpt.save(5, ck.TrainState(saved))
    mtime = (path / MARKER).stat().st_mtime_ns
    assert ckpt.save(5, ck.TrainState(saved)) == path
    assert (path / MARKER).stat().st_mtime_ns == mtime
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16))
    state = ck.TrainState(fresh)
    assert ck.Checkpointer(tmp_path).load(ckpt.latest(), state).step == 5
    assert torch.equal(fresh[0].weight, saved[0].weight)


def test_what_a_run_has_seen_carries_on_through_its_checkpoints(tmp_path: Path) -> None:
    """Samples, tokens and seconds go into checkpoint.json and come back on load; a checkpoint
    saved before they were kept gives its step times the global batch it recorded."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    state = ck.TrainState(model, config={"train_batch_size": 4, "max_context_width": 64})
    state.seen.samples, state.seen.tokens, state.seen.seconds = 40, 2560, 12.5
    path = ck.Checkpointer(tmp_path).save(5, state)
    marker = json.loads((path / MARKER).read_text())
    assert marker["seen"] == {"samples": 40, "tokens": 2560, "seconds": 12.5}
    loaded = ck.TrainState(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    ck.Checkpointer(tmp_path).load(path, loaded)
    assert (loaded.seen.samples, loaded.seen.tokens, loaded.seen.seconds) == (40, 2560, 12.5)
    del marker["seen"]
    marker.update(world_size=2, run_config=dict(marker["run_config"], grad_accum_steps=3))
    older = type(loaded.seen).from_marker(marker)
    assert (older.samples, older.tokens, older.seconds) == (120, 120 * 64, 0.0)  # 5 x 4 x 3 x 2


def test_shard_writer_splits_and_indexes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    writer = SafetensorsShardWriter(tmp_path / "multi", max_shard_bytes=1000)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.finish()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "multi" / HF_INDEX).read_text())
    assert index["metadata"]["total_size"] == 2000
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert differences(loaded, tensors) == []
    with pytest.raises(FileExistsError, match="already holds a model .model-00001-of-00003"):
        SafetensorsShardWriter(tmp_path / "multi")  # an export never replaces a model


def test_shard_writer_publishes_whole_models_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """Shards stay hidden parts until all are written (an export cut short leaves no model, and
    its parts go at the next export); the files get the mode a new file gets here, not the
    0o600 of safetensors' private temporary file."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / ".part-00000.safetensors").write_bytes(b"cut short")  # an earlier export died
    old_umask = os.umask(0o027)
    try:
        writer = SafetensorsShardWriter(out, max_shard_bytes=500)
        writer.add("a", torch.ones(100))
        assert not (out / ".part-00000.safetensors").exists()  # the stale part went
        writer.add("b", torch.ones(100))  # the first shard is written now: still a part
        assert existing_model(out) == [] and len(list(out.glob(".part-*"))) == 1
        files = writer.finish()
    finally:
        os.umask(old_umask)
    assert existing_model(out) == sorted([*(f.name for f in files), HF_INDEX])
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o640)}
    assert list(out.glob(".part-*")) == []


def test_convert_script_rejects_a_non_checkpoint_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scripts import convert_checkpoint

    (tmp_path / "model.safetensors").write_bytes(b"")
    assert convert_checkpoint.main([str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no .metadata" in err
    assert not (tmp_path / "out").exists()


def test_init_from_hf_is_checked_against_the_run_shape_before_start(tmp_path: Path) -> None:
    """--init_from_hf of another shape or RoPE base died in the load with a traceback after
    the process group and model existed; a tied checkpoint (Llama 3.2) could not load into the
    recipe's untied model at all."""
    from transformers import LlamaForCausalLM

    from model_utils.config import arguments
    from model_utils.model import modeling

    args = arguments.parse_args(TINY)
    torch.manual_seed(0)
    LlamaForCausalLM(modeling.model_config(args.model)).save_pretrained(tmp_path / "same")
    ck.check_hf_dir(tmp_path / "same", args.model)
    deeper = arguments.parse_args([*TINY, "--num_layers", "3", "--rope_theta", "500000"])
    with pytest.raises(ValueError) as exc:
        ck.check_hf_dir(tmp_path / "same", deeper.model)
    assert str(exc.value) == (
        f"--init_from_hf: {tmp_path / 'same'} does not fit this run's model: 9 "
        "tensor(s) differ, e.g. model.layers.2.self_attn.q_proj.weight missing (this model: "
        "(64, 64)); its config.json says --num_layers 2 --rope_theta 10000"
    )
    with pytest.raises(
        ValueError, match="another RoPE base; its config.json says --rope_theta 10000$"
    ):
        ck.check_hf_dir(
            tmp_path / "same", arguments.parse_args([*TINY, "--rope_theta", "1e6"]).model
        )

    tied_config = modeling.model_config(args.model)
    tied_config.tie_word_embeddings = True
    tied = LlamaForCausalLM(tied_config)
    tied.save_pretrained(tmp_path / "tied")
    ck.check_hf_dir(tmp_path / "tied", args.model)
    untied = LlamaForCausalLM(modeling.model_config(args.model))
    ck.load_hf_weights(untied, tmp_path / "tied")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert torch.equal(untied.lm_head.weight, tied.model.embed_tokens.weight)
    assert differences(dict(untied.state_dict()), dict(tied.state_dict())) == []


class _Planted:
    """A pickle that, loaded, writes a file: what a `.metadata` replaced by whoever can write a
    run folder would run on `pickle.load`."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (Path.write_text, (self.witness, "the checkpoint ran code"))


def test_nothing_read_from_a_checkpoint_folder_runs_code(tmp_path: Path, capsys) -> None:
    """A `.metadata` replaced by another pickle, its sha256 in the marker updated to match, is
    refused by every reader (a resume by path, `auto`, the converter) without running it; a
    packed value (step, schedule, data position, RNG) is read by the weights-only unpickler."""
    import hashlib
    import io
    import json
    import pickle

    from model_utils.checkpoint.checkpointer import pack, unpack
    from model_utils.checkpoint.manifest import MARKER, _Planner
    from scripts import convert_checkpoint

    root = tmp_path / "checkpoints"
    from helpers.checkpoints import save_plain_checkpoints

    save_plain_checkpoints(root, [2])
    step = root / "step_00000002"
    witness = tmp_path / "ran"
    evil = pickle.dumps(_Planted(witness))
    (step / ".metadata").write_bytes(evil)
    marker = json.loads((step / MARKER).read_text())
    marker["files"][".metadata"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (step / MARKER).write_text(json.dumps(marker))
    with pytest.raises(
        ck.ResumeRefused, match=r"\.metadata cannot be read \(UnpicklingError: it names "
    ):
        ck.checkpoint_to_resume(str(step), root, verify=False)
    with pytest.raises(ck.ResumeRefused):
        ck.checkpoint_to_resume("auto", root, verify=False)
    assert convert_checkpoint.main([str(step), str(tmp_path / "hf")]) == 2
    assert "it names pathlib.Path.write_text" in capsys.readouterr().err
    assert not witness.exists()
    assert unpack(pack({"step": 2, "numpy": np.random.get_state()}))["step"] == 2
    with pytest.raises(pickle.UnpicklingError):
        unpack(evil)
    with pytest.raises(pickle.UnpicklingError):
        _Planner().load_bytes(None, io.BytesIO(evil))
    assert not witness.exists()


def test_a_checkpoint_others_can_write_is_resumed_with_a_warning(tmp_path: Path, caplog) -> None:
    """Whoever can write a run folder decides what its resume loads: a group- or world-writable
    checkpoint, checkpoint folder or run folder is named in one warning; a private one is not."""
    import logging

    from helpers.checkpoints import save_plain_checkpoints

    run = tmp_path / "run"
    save_plain_checkpoints(run / "checkpoints", [2])
    for mode in (0o755, 0o1777, 0o777):  # a sticky folder (as /tmp): nobody replaces yours
        run.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            found = ck.checkpoint_to_resume("auto", run / "checkpoints")
        assert found == run / "checkpoints" / "step_00000002"
        shared = [r.getMessage() for r in caplog.records if "other users" in r.getMessage()]
        assert shared == (
            []
            if mode != 0o777
            else [
                f"{run} can be written by other users (mode 777): whoever writes there "
                f"changes what this resume loads; `chmod go-w {run}` keeps it yours"
            ]
        )


def test_metadata_pickled_by_python_3_12_reads_and_getattr_reaches_only_enum_members(
    tmp_path: Path,
) -> None:
    """Python >= 3.12 (an NGC image's) pickles DCP's memory-format enum member as getattr(its
    class, its name): read; a getattr for anything else is refused."""
    import enum
    import io
    import pickle

    from helpers.checkpoints import save_plain_checkpoints
    from torch.distributed.checkpoint.metadata import Metadata

    from model_utils.checkpoint.manifest import read_metadata

    class Py312(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    step = tmp_path / "step_00000001"
    save_plain_checkpoints(tmp_path, [1])
    saved = read_metadata(step)
    buffer = io.BytesIO()
    Py312(buffer, protocol=4).dump(saved)
    assert b"getattr" in buffer.getvalue()
    (step / ".metadata").write_bytes(buffer.getvalue())
    assert read_metadata(step).state_dict_metadata == saved.state_dict_metadata

    class Method:
        def __reduce__(self):
            return getattr, (Metadata, "__init__")

    (step / ".metadata").write_bytes(pickle.dumps(Method(), protocol=4))
    with pytest.raises(pickle.UnpicklingError, match="asks for .*Metadata.*__init__"):
        read_metadata(step)
