"""tools/make_code_corpus.py on a wheel made here (PyPI's wheels are what it downloads; the
wheel format is a zip): which files become documents, the held-out split, the tokenizer, the
counts, and a corpus train.py reads."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from model_utils.data.sources import is_held_out
from tools import make_code_corpus as corpus
from tools import make_corpus_and_tokenizer as kjv


def fake_wheel(folder: Path) -> Path:
    wheel = folder / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for i in range(60):
            archive.writestr(
                f"demo/mod{i}.py", f'"""Module {i}."""\n\ndef f{i}(x):\n    return x * {i}\n'
            )
        archive.writestr("demo/big.py", "x = 1\n" * (corpus.MAX_FILE_BYTES // 6 + 1))  # too big
        archive.writestr("demo/empty.py", "")
        archive.writestr("demo/latin1.py", "s = '\xe9'\n".encode("latin-1"))  # not UTF-8
        archive.writestr("demo/data.json", "{}")
    return wheel


def test_documents_are_the_wheels_utf8_python_files(tmp_path) -> None:
    docs = list(corpus.documents(fake_wheel(tmp_path)))
    assert len(docs) == 60 and {d["package"] for d in docs} == {"demo"}
    assert docs[0]["text"].startswith(f"# {docs[0]['path']}\n")


def test_build_writes_a_corpus_and_tokenizer_with_its_counts(tmp_path, monkeypatch) -> None:
    wheel = fake_wheel(tmp_path)
    monkeypatch.setattr(corpus, "download", lambda packages, into: [wheel])
    out = tmp_path / "text"
    stats = corpus.build(out, ["sympy"], vocab_size=300)
    assert stats["documents"] == 60 and set(stats["wheels"]) == {wheel.name}
    lines = [json.loads(line) for line in gzip.open(out / "code.jsonl.gz", "rt")]
    held_out = sum(is_held_out(d["text"]) for d in lines)
    assert stats["validation_tokens"] > 0 if held_out else stats["validation_tokens"] == 0
    assert stats["train_tokens"] > 60 * 5 and stats["bytes"] == sum(len(d["text"]) for d in lines)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert len(tokenizer) == 300 and tokenizer.eos_token == corpus.EOS


def test_an_unknown_package_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        corpus.main(["--out", "/nonexistent", "--packages", "sympy,leftpad"])
    assert exit_info.value.code == 2 and "--packages: unknown leftpad" in capsys.readouterr().err


def test_bad_input_is_one_line_before_any_download(tmp_path, capsys, monkeypatch) -> None:
    """A file or a folder below a file as --out, a vocabulary smaller than the bytes: refused
    (exit 2) before pip runs; pip that cannot reach an index: its own last line, no traceback."""
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    taken = tmp_path / "taken"
    taken.write_text("x")
    cases = [
        (["--out", str(taken)], f"--out {taken} is a file, not a directory: choose another"),
        (["--out", str(taken / "sub")], f"cannot be created: {taken} is a file; choose another"),
        (["--out", str(tmp_path / "new"), "--vocab_size", "0"], "--vocab_size must be at least"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_info:
            corpus.main(argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err
    failed = corpus.subprocess.CompletedProcess([], 1, "", "Looking in indexes\nERROR: No index\n")
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(SystemExit) as exit_info:
        corpus.download(["sympy"], tmp_path)
    assert exit_info.value.code == 1 and capsys.readouterr().err == (
        "make_code_corpus.py: error: pip cannot download sympy==1.14.0: ERROR: No index\n"
    )


def refusals(main, tmp_path, monkeypatch, capsys, cases) -> None:
    """Each (argv, line): exit 2 with exactly that line on stderr, before any subprocess (pip,
    `bible`) runs, and nothing written in tmp_path (the current folder too)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kjv.subprocess, "run", lambda *a, **k: pytest.fail("a command ran"))
    before = sorted(tmp_path.rglob("*"))
    for argv, line in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert (exit_info.value.code, capsys.readouterr().err) == (2, line + "\n")
    assert sorted(tmp_path.rglob("*")) == before


def test_an_empty_out_or_a_symlink_loop_is_refused_before_the_download(
    tmp_path, monkeypatch, capsys
) -> None:
    """--out "" built the corpus in the current folder; a loop passed the check and died with
    a FileExistsError traceback after the download."""
    (tmp_path / "loop").symlink_to("loop")
    prog = "make_code_corpus.py: error:"
    refusals(
        corpus.main,
        tmp_path,
        monkeypatch,
        capsys,
        [
            (
                ["--out", ""],
                f"{prog} --out is empty (an unset shell variable?): give a value",
            ),
            (
                ["--out", "loop"],
                f"{prog} --out loop cannot be created: loop is a link that loops (to loop): "
                "choose another --out",
            ),
        ],
    )


def test_the_kjv_corpus_refuses_a_bad_out_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """make_corpus_and_tokenizer never checked --out: a file died with a FileExistsError
    traceback, "" wrote into the current folder, --check of an empty folder died in filecmp."""
    (tmp_path / "taken").write_text("x")
    (tmp_path / "empty").mkdir()
    prog = "make_corpus_and_tokenizer.py: error:"
    refusals(
        kjv.main,
        tmp_path,
        monkeypatch,
        capsys,
        [
            (
                ["--out", "taken"],
                f"{prog} --out taken is a file, not a directory: choose another --out",
            ),
            (["--out", ""], f"{prog} --out is empty (an unset shell variable?): give a value"),
            (
                ["--check", "--out", "empty"],
                f"{prog} --out empty holds no kjv.jsonl.gz: give the folder it was written to",
            ),
        ],
    )
