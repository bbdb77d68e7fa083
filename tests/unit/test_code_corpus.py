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
        (["--out", str(taken)], f"--out {taken} is a file: give a folder"),
        (["--out", str(taken / "sub")], f"cannot be written ({taken} is read-only or not a"),
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
    assert (
        exit_info.value.code
        == "make_code_corpus: pip cannot download sympy==1.14.0: ERROR: No index"
    )
