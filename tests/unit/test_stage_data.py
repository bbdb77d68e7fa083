"""scripts/stage_data.py in this process: names for staged datasets (Hub names and local
files), its one-line refusals before anything is written, and a staging that fails part-way
leaving nothing behind. A staging that train.py then trains from offline:
tests/integration/test_stage_data_processes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.procs import script_refusal

from scripts import stage_data

ROOT = Path(__file__).resolve().parents[2]


def test_slugs_name_hub_datasets_and_local_files() -> None:
    assert stage_data.slug("allenai/c4", "en") == "allenai--c4-en"
    assert stage_data.slug(str(ROOT / "data" / "kjv.jsonl.gz"), None) == "kjv"
    assert stage_data.slug("NousResearch/Meta-Llama-3-8B", None) == "NousResearch--Meta-Llama-3-8B"


def test_the_current_folder_is_staged_under_its_own_name(tmp_path, monkeypatch) -> None:
    """`--dataset .` had no name: the dataset landed in --out itself, beside tokenizers/."""
    (tmp_path / "mycode").mkdir()
    monkeypatch.chdir(tmp_path / "mycode")
    assert stage_data.slug(".", None) == stage_data.slug("./", None) == "mycode"


# -- refusals and failures: one line, and nothing left behind ---------------------------------

LONG_NAME = "n" * 300  # over NAME_MAX (255 bytes): ENAMETOOLONG from the first stat()


def corpus(folder: Path, rows: list[object]) -> Path:
    """A local JSON-lines dataset whose records hold `rows` in their "text" column, staged as
    `folder`'s name."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{folder.name}.jsonl"
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    return path


def stage_argv(out: Path, dataset: Path, *extra: str) -> list[str]:
    tokenizer = str(ROOT / "data" / "tokenizer")
    argv = ["--out", str(out), "--dataset", str(dataset), "--tokenizer", tokenizer]
    return [*argv, "--documents", "40", "--shards", "4", *extra]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    return script_refusal(stage_data.main, "stage_data.py", argv, capsys, status)


def test_a_missing_text_column_is_refused_before_anything_is_written(tmp_path, capsys) -> None:
    """It died with a DataError traceback and left X/tokenizers/ and an empty dataset folder."""
    dataset = corpus(tmp_path / "src", [f"document {i}" for i in range(50)])
    out = tmp_path / "stage"
    err = refused(stage_argv(out, dataset, "--text_column", "nope"), capsys)
    assert f"{dataset} line 1 has no column 'nope' (columns: text): pass --text_column" in err
    assert not out.exists()


def test_a_wrong_column_the_scan_does_not_read_is_refused_at_the_first_document(
    tmp_path, capsys, monkeypatch
) -> None:
    """Hub data is not scanned at start-up (train.py meets it at the first read): the first
    document is read before anything is written."""
    dataset = corpus(tmp_path / "src", [f"document {i}" for i in range(50)])
    monkeypatch.setattr(stage_data.data, "check_local_data", lambda *_: None)  # as for hub data
    out = tmp_path / "stage"
    assert "has no column 'nope'" in refused(
        stage_argv(out, dataset, "--text_column", "nope"), capsys
    )
    assert not out.exists()


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys (Linux)")
def test_an_out_it_cannot_create_is_one_line(tmp_path, capsys) -> None:
    """mkdir in /sys died with PermissionError (root: EPERM, which access() does not foresee)."""
    dataset = corpus(tmp_path / "src", ["a document"])
    err = refused(stage_argv(Path("/sys/stage"), dataset), capsys)
    assert "--out /sys/stage cannot be" in err and "choose another --out" in err


@pytest.mark.parametrize("flag", ["--out", "--dataset", "--tokenizer"])
def test_a_name_over_255_bytes_or_an_empty_out_is_one_line(tmp_path, capsys, flag) -> None:
    dataset = corpus(tmp_path / "src", ["a document"])
    argv = stage_argv(tmp_path / "stage", dataset)
    argv[argv.index(flag) + 1] = str(tmp_path / LONG_NAME)
    before = sorted(tmp_path.rglob("*"))
    err = refused(argv, capsys)
    assert f"{flag}: the name 'nnnn" in err and "is 300 bytes long" in err
    assert sorted(tmp_path.rglob("*")) == before
    argv[argv.index(flag) + 1] = ""
    if flag == "--out":  # Path("") is the current directory
        assert "--out is empty" in refused(argv, capsys)


@pytest.mark.parametrize("name", ["src", "tokenizers", "tokenizers/tokenizer"])
def test_a_file_where_the_staging_makes_a_folder_is_refused_first(tmp_path, capsys, name) -> None:
    """A file named as the dataset's folder or the tokenizers' in --out: the dataset was written
    and removed, then "--out ... cannot be written (Not a directory)" (--out was fine), exit 1."""
    dataset = corpus(tmp_path / "src", ["a document"])
    out = tmp_path / "stage"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("mine")
    before = sorted(out.rglob("*"))
    assert refused(stage_argv(out, dataset), capsys) == (
        f"stage_data.py: error: {out / name} is a file, not a folder: move it or choose another "
        "--out\n"
    )
    assert sorted(out.rglob("*")) == before and (out / name).read_text() == "mine"


def test_a_bad_record_past_the_scan_removes_what_was_staged(tmp_path, capsys, monkeypatch) -> None:
    """A number in the text column far into the data (train.py's start-up scan reads 8 MiB per
    file) stops the staging after some shards were written: they go, so a second try is not
    refused as 'already holds a staged dataset'. The dataset folder, existing and empty, stays."""
    dataset = corpus(tmp_path / "src", [*(f"document {i}" for i in range(30)), 12345])
    monkeypatch.setattr(stage_data.data, "check_local_data", lambda *_: None)  # past the scan
    out = tmp_path / "stage"
    (out / "src").mkdir(parents=True)
    err = refused(stage_argv(out, dataset), capsys)
    assert "column 'text' holds a number ('12345'), not text" in err
    assert "(what this staging wrote is removed)" in err
    assert sorted(out.rglob("*")) == [out / "src"]


@pytest.mark.parametrize(
    "failure, status, words",
    [
        (OSError(28, "No space left on device"), 1, "--out {out} cannot be written (No space"),
        (KeyboardInterrupt(), 130, "interrupted; what this staging wrote is removed"),
    ],
)
def test_a_write_that_fails_part_way_removes_what_was_staged(
    tmp_path, capsys, monkeypatch, failure, status, words
) -> None:
    dataset = corpus(tmp_path / "src", [f"document {i}" for i in range(50)])
    write_shard = stage_data.write_shard

    def second_fails(path: Path, *args):
        if "00001-of" in path.name:
            raise failure
        return write_shard(path, *args)

    monkeypatch.setattr(stage_data, "write_shard", second_fails)
    out = tmp_path / "stage"
    assert words.format(out=out) in refused(stage_argv(out, dataset), capsys, status)
    assert not out.exists()


def test_a_tokenizer_staged_before_is_reused_and_another_of_its_name_refused(
    tmp_path, capsys
) -> None:
    """A second dataset staged into the same --out finds its tokenizer there and does not write
    it again; a different tokenizer under the same name would have been written over the one a
    staged dataset trains with."""
    from transformers import AutoTokenizer

    out = tmp_path / "stage"
    first = corpus(tmp_path / "one", [f"document {i}" for i in range(50)])
    assert stage_data.main(stage_argv(out, first)) == 0
    staged = out / "tokenizers" / "tokenizer" / "tokenizer.json"
    mtime = staged.stat().st_mtime_ns
    second = corpus(tmp_path / "two", [f"text {i}" for i in range(50)])
    assert stage_data.main(stage_argv(out, second)) == 0
    assert staged.stat().st_mtime_ns == mtime
    capsys.readouterr()

    other = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))
    other.add_tokens(["<extra>"])
    other.save_pretrained(str(tmp_path / "other" / "tokenizer"))
    third = corpus(tmp_path / "three", ["a document"])
    argv = stage_argv(out, third)
    argv[argv.index("--tokenizer") + 1] = str(tmp_path / "other" / "tokenizer")
    err = refused(argv, capsys)
    assert f"{out / 'tokenizers' / 'tokenizer'} holds another tokenizer" in err
    assert staged.stat().st_mtime_ns == mtime and not (out / "three").exists()


def test_a_hub_dataset_it_cannot_reach_is_one_quick_line(tmp_path, capsys, monkeypatch) -> None:
    """The same one look-up train.py makes of a hub name, before the tokenizer or any file:
    staging went on to the datasets library, which retried for minutes, page after page."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "stage"
    err = refused(stage_argv(out, "someone/no-such-corpus"), capsys)
    assert err.startswith(
        "stage_data.py: error: --dataset someone/no-such-corpus: no local file or folder of that "
        "name, and hub look-ups are off (HF_DATASETS_OFFLINE=1)"
    )
    assert not out.exists()


def test_a_hub_that_does_not_answer_is_one_quick_line(tmp_path, capsys, monkeypatch) -> None:
    from helpers.endpoints import silent_hub
    from huggingface_hub import constants

    out = tmp_path / "stage"
    with silent_hub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        err = refused(stage_argv(out, "someone/no-such-corpus"), capsys)
    assert 1 <= hub.connections <= 2  # one look-up, not a loader's minute of retries
    assert f"and the Hugging Face hub ({hub.url}) did not answer within " in err
    assert not out.exists()


def test_every_file_of_the_set_is_written_and_more_shards_than_documents_refused(
    tmp_path, capsys
) -> None:
    """Files named "-of-00004" are a set of four: 6 documents went 2, 2, 2 and no fourth file,
    and 2 documents in 5 shards staged two files of "a set of five", exit 0."""
    import gzip

    dataset = corpus(tmp_path / "src", [f"document {i}" for i in range(50)])
    out = tmp_path / "stage"
    assert stage_data.main([*stage_argv(out, dataset), "--documents", "6"]) == 0
    files = sorted(out.rglob("train-*.jsonl.gz"))
    assert [f.name for f in files] == [f"train-{i:05d}-of-00004.jsonl.gz" for i in range(4)]
    assert [len(gzip.decompress(f.read_bytes()).splitlines()) for f in files] == [2, 2, 1, 1]
    capsys.readouterr()
    other = tmp_path / "other"
    err = refused([*stage_argv(other, dataset), "--documents", "2", "--shards", "5"], capsys)
    assert "and --shards at most --documents, got 2/5" in err and not other.exists()
