"""Rebuild the bundled offline corpus (data/kjv.jsonl.gz) and its tokenizer (data/tokenizer/).

Why this script exists: the default run must need no network, so the repository ships a small
public-domain corpus and a tokenizer trained on it. Anyone can check that the committed files are
what this script makes (it is byte-for-byte reproducible; see data/README.md for the checksums).

Source: the King James Version as printed by the Debian package `bible-kjv` (4.38):
    apt-get install -y bible-kjv
    .venv/bin/python -m tools.make_corpus_and_tokenizer          # write data/...
    .venv/bin/python -m tools.make_corpus_and_tokenizer --check  # rebuild in a temp dir, compare

Documents are chapters (1,189 of them): a title line ("Genesis 1") then one verse per line,
without verse numbers. The tokenizer is a byte-level BPE (vocab 8192, one special token
`<|endoftext|>` used as EOS/BOS) trained only on the chapters that model_utils.data uses for
training, so validation text is never seen by the tokenizer either.
"""

from __future__ import annotations

import filecmp
import gzip
import hashlib
import io
import itertools
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from model_utils.config.flag_rules import value_problem
from model_utils.data.sources import is_held_out
from model_utils.errors import OneLineParser, said
from model_utils.run import outputs

REPO = Path(__file__).resolve().parent.parent
PROG = "make_corpus_and_tokenizer.py"


BIBLE_RANGE = "Gen1:1-Rev22:21"
EXPECTED_SOURCE_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
VOCAB_SIZE = 8192
EOS = "<|endoftext|>"

# The 66 books in the order `bible` prints them; its abbreviations are mapped by position.
BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1_Samuel 2_Samuel 1_Kings "
    "2_Kings 1_Chronicles 2_Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes "
    "Song_of_Solomon Isaiah Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah "
    "Micah Nahum Habakkuk Zephaniah Haggai Zechariah Malachi Matthew Mark Luke John Acts Romans "
    "1_Corinthians 2_Corinthians Galatians Ephesians Philippians Colossians 1_Thessalonians "
    "2_Thessalonians 1_Timothy 2_Timothy Titus Philemon Hebrews James 1_Peter 2_Peter 1_John "
    "2_John 3_John Jude Revelation"
)
BOOK_NAMES = [name.replace("_", " ") for name in BOOKS.split()]
VERSE = re.compile(r"^(?P<book>[0-9]?[A-Za-z]+)(?P<chapter>[0-9]+):(?P<verse>[0-9]+) (?P<text>.*)$")


def read_bible() -> str:
    """Print the whole KJV with the Debian `bible` tool and check it is the expected text."""
    try:
        out = subprocess.run(
            ["bible", "-f", BIBLE_RANGE], check=True, capture_output=True, text=True
        ).stdout
    except FileNotFoundError:
        raise SystemExit(said(PROG, "`bible` not found: apt-get install -y bible-kjv")) from None
    digest = hashlib.sha256(out.encode()).hexdigest()
    if digest != EXPECTED_SOURCE_SHA256:
        print(
            f"warning: source text sha256 {digest} differs from the recorded one", file=sys.stderr
        )
    return out


def chapters(text: str) -> Iterator[dict]:
    """Group verse lines into chapter documents: {"text", "book", "chapter"}."""
    verses = []
    for line in text.splitlines():
        match = VERSE.match(line)
        if match is None:
            raise ValueError(f"unexpected line in bible output: {line[:80]!r}")
        verses.append(match)
    abbreviations = list(dict.fromkeys(verse["book"] for verse in verses))
    if len(abbreviations) != len(BOOK_NAMES):
        raise ValueError(f"expected {len(BOOK_NAMES)} books, found {len(abbreviations)}")
    by_chapter = itertools.groupby(verses, lambda verse: (verse["book"], int(verse["chapter"])))
    for (abbreviation, chapter), group in by_chapter:
        book = BOOK_NAMES[abbreviations.index(abbreviation)]
        lines = "\n".join(verse["text"].strip() for verse in group)
        yield {"text": f"{book} {chapter}\n{lines}", "book": book, "chapter": chapter}


def write_jsonl_gz(documents: list[dict], path: Path) -> None:
    """gzip with mtime=0 and no file name so the bytes depend only on the content."""
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents).encode()
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        gz.write(payload)
    path.write_bytes(buffer.getvalue())


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Byte-level BPE like GPT-2's, saved in the Hugging Face format AutoTokenizer loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS)
    wrapped.save_pretrained(str(out_dir))
    # transformers 5 records its new class name; the 4.x name loads in both major versions
    # (e.g. in a GPU container that ships an older transformers).
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build(out_dir: Path) -> list[Path]:
    """Write the corpus and the tokenizer under out_dir; return the files written."""
    documents = list(chapters(read_bible()))
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "kjv.jsonl.gz"
    write_jsonl_gz(documents, corpus)
    training_texts = [doc["text"] for doc in documents if not is_held_out(doc["text"])]
    train_tokenizer(training_texts, out_dir / "tokenizer")
    held_out = len(documents) - len(training_texts)
    print(f"{len(documents)} chapters ({held_out} held out for validation) -> {corpus}")
    return [corpus, *sorted((out_dir / "tokenizer").iterdir())]


def out_folder(parser: OneLineParser, out: str) -> Path:
    """--out as a folder this command can write, else the parser's one line (exit 2) before
    anything is read, downloaded or written: empty ("" was the current folder), a file or a
    symlink loop in the way, a folder it cannot create or write (probed, leaving nothing)."""
    path, flag = Path(out), "--out"
    problem = value_problem(flag, out, required=True) or outputs.location_problem(flag, path)
    if problem := problem or outputs.probe_write(flag, path):
        parser.error(problem)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "data"), help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="rebuild in a temporary directory and compare"
    )
    args = parser.parse_args(argv)
    if not args.check:
        out = out_folder(parser, args.out)
        for path in build(out):
            print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(out)}")
        return
    if not (Path(args.out) / "kjv.jsonl.gz").is_file():
        parser.error(f"--out {args.out} holds no kjv.jsonl.gz: give the folder it was written to")
    with tempfile.TemporaryDirectory() as tmp:
        names = [str(p.relative_to(tmp)) for p in build(Path(tmp))]
        _, mismatch, missing = filecmp.cmpfiles(tmp, args.out, names, shallow=False)
    if mismatch or missing:
        raise SystemExit(said(PROG, f"{args.out} differs: {', '.join(mismatch + missing)}", 1))
    print("rebuilt files are identical to the committed ones")


if __name__ == "__main__":
    main()
