"""scripts/convert_checkpoint.py's refusals and clean failures, in this process: a damaged
checkpoint is refused as train.py's resume refuses it (by path) or skipped for the newest intact
one (a folder of checkpoints); an out_dir it cannot write, or a name over 255 bytes, is one line;
an export that fails part-way leaves nothing behind. The successful conversions of real runs are
in tests/integration/test_checkpoint_processes.py and tests/unit/test_cross_impl.py."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import convert_refused, save_llama_checkpoints

from model_utils.checkpoint.hf import HF_SINGLE
from model_utils.checkpoint.manifest import MARKER
from scripts import convert_checkpoint

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LONG_NAME = "n" * 300  # over NAME_MAX (255 bytes): ENAMETOOLONG from the first stat()


def overwrite_bytes(path: Path) -> Path:
    """4 bytes changed in the middle of the shard: the size stays, only the sha256 tells."""
    shard = path / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.seek(shard.stat().st_size // 2)
        fh.write(b"XXXX")
    return shard


def test_a_damaged_checkpoint_given_by_path_is_refused_naming_the_file(tmp_path, capsys) -> None:
    """It was exported as a model (exit 0) while train.py refused to resume from it."""
    [path] = save_llama_checkpoints(tmp_path / "ckpt", (2,))
    shard = overwrite_bytes(path)
    out = tmp_path / "hf"
    err = convert_refused([str(path), str(out)], capsys)
    assert f"checkpoint {path} is damaged: {shard} does not match its sha256" in err
    assert not out.exists()
    (path / MARKER).unlink()  # an incomplete save: refused too, as before
    assert "has no checkpoint.json" in convert_refused([str(path), str(out)], capsys)


def test_a_folder_of_checkpoints_converts_its_newest_intact_one(tmp_path, capsys) -> None:
    """As train.py's `auto` resume: a damaged newer checkpoint is skipped with a warning and the
    line says which one was converted; every one damaged is refused."""
    from safetensors.torch import load_file

    folder = tmp_path / "ckpt"
    older, newer = save_llama_checkpoints(folder, (1, 2))
    overwrite_bytes(newer)
    out = tmp_path / "hf"
    assert convert_checkpoint.main([str(folder), str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"{older} (step 1, newest intact in {folder}) -> {out}")
    assert stderr == (
        f"convert_checkpoint.py: warning: skipped the damaged checkpoint {newer.name}: "
        f"{newer / '__0_0.distcp'} does not match its sha256 (changed since the save)\n"
    )
    weights = load_file(str(out / HF_SINGLE))
    assert torch.all(weights["model.embed_tokens.weight"] == 1.0)  # step 1's, not step 2's
    assert sorted(p.name for p in folder.iterdir()) == [older.name, newer.name]  # left as is

    overwrite_bytes(older)
    again = tmp_path / "hf2"
    err = convert_refused([str(folder), str(again)], capsys)
    assert f"every checkpoint in {folder} is damaged (newest {newer.name}: " in err
    assert not again.exists()


def test_an_out_dir_inside_the_checkpoints_folder_is_refused(tmp_path, capsys) -> None:
    """An export into a step folder, or beside the steps, went when the run pruned or saved
    that step again: refused, and nothing is left in the checkpoints' folder."""
    folder = tmp_path / "ckpt"
    [path] = save_llama_checkpoints(folder, (1,))
    [other] = save_llama_checkpoints(tmp_path / "other", (1,))  # another run's checkpoint
    for out, inside in ((path / "hf", path), (folder / "hf", folder), (other / "x/hf", other)):
        err = convert_refused([str(path), str(out)], capsys)
        assert f"out_dir {out} is inside {inside}, where a run's checkpoints are pruned" in err
    assert [p.name for p in folder.iterdir()] == [path.name] and not (path / "hf").exists()
    assert not (other / "x").exists()


def test_a_config_or_tokenizer_of_the_users_is_never_replaced(tmp_path, capsys) -> None:
    """Only weights counted as a model there: a folder holding the user's own config.json and
    tokenizer.json was exported into, both replaced, exit 0. A file the export writes under a
    name no one foresaw is not replaced either: the writer stops before it publishes."""
    from model_utils.checkpoint import hf

    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    out = tmp_path / "hf"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "notes.txt"):
        (out / name).write_text("mine")
    err = convert_refused([str(path), str(out)], capsys)
    assert f"error: out_dir {out} already holds a model (config.json, tokenizer.json):" in err
    assert {p.name: p.read_text() for p in out.iterdir()} == dict.fromkeys(
        ["config.json", "tokenizer.json", "notes.txt"], "mine"
    )
    (out / "config.json").unlink()
    (out / "tokenizer.json").unlink()
    writer = hf.SafetensorsShardWriter(out)  # notes.txt is no model's
    writer.staging.mkdir()
    (writer.staging / "notes.txt").write_text("the export's")
    writer.add("w", torch.ones(2))
    with pytest.raises(FileExistsError, match="notes.txt exists: an export never replaces it"):
        writer.finish()
    assert (out / "notes.txt").read_text() == "mine" and hf.existing_model(out) == []


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys (Linux)")
def test_an_out_dir_it_cannot_create_is_one_line(tmp_path, capsys) -> None:
    """mkdir in /sys died with PermissionError (root: EPERM, which access() does not foresee)."""
    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    err = convert_refused([str(path), "/sys/nope"], capsys)
    assert "out_dir /sys/nope cannot be" in err and "choose another out_dir" in err
    assert not Path("/sys/nope").exists()


@pytest.mark.parametrize("which", ["checkpoint", "out_dir"])
def test_a_name_over_255_bytes_or_an_empty_path_is_one_line(tmp_path, capsys, which) -> None:
    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    argv = {
        "checkpoint": [str(tmp_path / LONG_NAME), str(tmp_path / "hf")],
        "out_dir": [str(path), str(tmp_path / LONG_NAME / "hf")],
    }[which]
    before = sorted(tmp_path.iterdir())
    err = convert_refused(argv, capsys)
    assert "File name too long (a file or folder name is at most 255 bytes)" in err
    assert sorted(tmp_path.iterdir()) == before
    argv[["checkpoint", "out_dir"].index(which)] = ""  # an unset variable: the current folder
    assert f"{which} is empty" in convert_refused(argv, capsys)


@pytest.mark.parametrize(
    "failure, status, words",
    [
        (OSError(errno.ENOSPC, "No space left on device"), 1, "no space left on the device"),
        (KeyboardInterrupt(), 130, "interrupted; nothing was exported"),
    ],
)
@pytest.mark.parametrize("out_exists", [False, True])
def test_an_export_that_fails_part_way_leaves_nothing(
    tmp_path, capsys, monkeypatch, failure, status, words, out_exists
) -> None:
    """The whole folder is written and published (weights, config, generation config, the
    tokenizer's files), then the export fails: all of it goes; a folder the user had keeps its
    own files."""
    from model_utils.checkpoint import hf

    publish = hf.SafetensorsShardWriter.finish

    def fail(writer: hf.SafetensorsShardWriter) -> None:
        publish(writer)
        assert (writer.out_dir / "tokenizer.json").is_file()
        raise failure

    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    out = tmp_path / "new" / "hf"
    if out_exists:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(hf.SafetensorsShardWriter, "finish", fail)
    err = convert_refused([str(path), str(out)], capsys, status)
    assert words in err
    if out_exists:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not (tmp_path / "new").exists()


def copy_of_the_run_tokenizer(folder: Path, extra_token: str | None = None) -> Path:
    """The bundled tokenizer saved elsewhere; with `extra_token`, another tokenizer (one more
    token: another fingerprint) under the same kind of path."""
    from model_utils import data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    if extra_token:
        tokenizer.add_tokens([extra_token])
    tokenizer.save_pretrained(str(folder))
    return folder


def test_the_run_tokenizer_gone_is_refused_until_given_with_tokenizer(tmp_path, capsys) -> None:
    """The recorded tokenizer folder was removed: refused in one line naming --tokenizer,
    nothing written; another tokenizer given is refused by its fingerprint; the run's, given,
    converts to a folder whose tokenizer is the run's."""
    from transformers import AutoTokenizer

    from model_utils import data

    recorded = copy_of_the_run_tokenizer(tmp_path / "tok")
    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,), tokenizer=str(recorded))
    shutil.rmtree(recorded)
    out = tmp_path / "hf"
    err = convert_refused([str(path), str(out)], capsys)
    assert f"checkpoint {path} records the tokenizer {recorded}, which cannot be used " in err
    assert err.rstrip().endswith("give the run's tokenizer with --tokenizer PATH")
    assert not out.exists()

    other = copy_of_the_run_tokenizer(tmp_path / "other", extra_token="<|pad|>")
    err = convert_refused([str(path), str(out), "--tokenizer", str(other)], capsys)
    assert f"tokenizer {other} is not the run's: its fingerprint " in err
    assert not out.exists()

    given = copy_of_the_run_tokenizer(tmp_path / "given")
    assert convert_checkpoint.main([str(path), str(out), "--tokenizer", str(given)]) == 0
    exported = AutoTokenizer.from_pretrained(str(out))
    assert data.tokenizer_fingerprint(exported) == data.tokenizer_fingerprint(
        data.load_tokenizer(str(given))
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_converter_reads_the_fp32_masters_the_optimizer_kept(tmp_path) -> None:
    """A --master_weights optimizer run stores its parameters rounded to bf16; --export_hf
    writes the fp32 masters, and so must the converter (it wrote the rounded ones)."""
    import torch.distributed.checkpoint as dcp

    from model_utils.checkpoint.layout import iter_dcp_model_layers

    master = torch.tensor([1.0 + 2**-12, 3.0])  # 1 + 2^-12 is no bf16 value
    dcp.save(
        {
            "model.model.layers.0.mlp.up_proj.weight": master.to(torch.bfloat16),
            "model.model.norm.weight": torch.ones(2, dtype=torch.bfloat16),  # no master
            "optimizer.state.model.layers.0.mlp.up_proj.weight.master_param": master,
            "optimizer.state.model.layers.0.mlp.up_proj.weight.exp_avg": torch.zeros(2),
        },
        checkpoint_id=tmp_path,
    )
    read = {name: t for layer in iter_dcp_model_layers(tmp_path) for name, t in layer.items()}
    assert read["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert torch.equal(read["model.layers.0.mlp.up_proj.weight"], master)
    assert read["model.norm.weight"].dtype == torch.bfloat16


def test_a_run_folder_converts_its_newest_checkpoint(tmp_path, capsys) -> None:
    """A run folder is where a user's checkpoints are (RUN/checkpoints): its newest is taken,
    where the refusal told a converter's user about train.py's flags; a path that does not
    exist is said so, without 'it holds no checkpoint'."""
    older, newer = save_llama_checkpoints(tmp_path / "run" / "checkpoints", (1, 2))
    assert convert_checkpoint.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith(
        f"{newer} (step 2, newest intact in {newer.parent}) -> {tmp_path / 'hf'}"
    )
    err = convert_refused([str(tmp_path / "nope"), str(tmp_path / "hf2")], capsys)
    assert err.endswith(f"checkpoint {tmp_path / 'nope'} does not exist\n")
