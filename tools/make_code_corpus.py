"""Real text for the whole-model loss A/B: the Python source of five pinned PyPI packages,
86 MB in 4,442 files, with a 32k byte-level BPE trained on its training part.

Why this text: the A/B must run on a GPU machine with no network, from data that can be rebuilt
by anyone from a source reachable where the project is developed (the package registries), in
transfers of at most 64 MiB. The bundled Bible is 1M tokens, which a 1B model at 32k tokens a
step reads in 30 steps; this corpus is 24M tokens of real, varied text (code and its
docstrings) under permissive licences, never repeated within a few hundred steps.

    .venv/bin/python -m tools.make_code_corpus --out .gpu/text     # 32 s on 2 cores
    .venv/bin/python -m tools.make_code_corpus --out /tmp/t --packages sympy --vocab_size 4096

Writes ``code.jsonl.gz`` (one document per file: ``{"text", "package", "path"}``, the text
starting with a ``# package/path`` line, in a fixed shuffled order) and ``tokenizer/``. The
validation part is model_utils.data's usual hash-held-out ~5% of documents, which the tokenizer
never sees either. docs/data.md names the packages, their licences and the sizes.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from model_utils.data.sources import is_held_out
from model_utils.errors import OneLineParser, said
from tools.make_corpus_and_tokenizer import EOS, out_folder, train_tokenizer, write_jsonl_gz

#: package -> (version, licence): the five largest pure-source trees of permissively licensed
#: packages in this project's environment.
PACKAGES = {
    "sympy": ("1.14.0", "BSD-3-Clause"),
    "pandas": ("3.1.1", "BSD-3-Clause"),
    "scipy": ("1.17.1", "BSD-3-Clause"),
    "numpy": ("2.4.6", "BSD-3-Clause (bundled parts: see its LICENSE.txt)"),
    "SQLAlchemy": ("2.1.9", "MIT"),
}
#: One platform for every wheel, so the same pins give the same files anywhere.
PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--abi", "cp311")
VOCAB_SIZE = 32768
#: A byte-level BPE holds the 256 bytes and EOS before any merge.
MIN_VOCAB = 257
#: Files above this are generated tables (unicode data, test vectors), not code.
MAX_FILE_BYTES = 400_000
SHUFFLE_SEED = 0
PROG = "make_code_corpus.py"


def download(packages: list[str], into: Path) -> list[Path]:
    """The pinned wheels, from PyPI (pip's cache when it has them)."""
    pins = [f"{name}=={PACKAGES[name][0]}" for name in packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run([*cmd, *PLATFORM, "-d", str(into), *pins], capture_output=True, text=True)
    if done.returncode:
        last = [line for line in done.stderr.splitlines() if line.strip()] or ["no message"]
        raise SystemExit(said(PROG, f"pip cannot download {' '.join(pins)}: {last[-1].strip()}", 1))
    return sorted(into.glob("*.whl"))


def documents(wheel: Path) -> Iterator[dict]:
    """Every UTF-8 .py file of a wheel below MAX_FILE_BYTES, one document each."""
    package = wheel.name.split("-")[0]
    with zipfile.ZipFile(wheel) as archive:
        for info in sorted(archive.infolist(), key=lambda i: i.filename):
            if not info.filename.endswith(".py") or not 0 < info.file_size <= MAX_FILE_BYTES:
                continue
            try:
                text = archive.read(info).decode("utf-8")
            except UnicodeDecodeError:
                continue
            yield {"text": f"# {info.filename}\n{text}", "package": package, "path": info.filename}


def build(out_dir: Path, packages: list[str], vocab_size: int) -> dict:
    """Write the corpus and its tokenizer; return what docs/data.md states about them."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(packages, Path(tmp))
        sha = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels}
        docs = [doc for wheel in wheels for doc in documents(wheel)]
    random.Random(SHUFFLE_SEED).shuffle(docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(docs, out_dir / "code.jsonl.gz")
    train = [d["text"] for d in docs if not is_held_out(d["text"])]
    train_tokenizer(train, out_dir / "tokenizer", vocab_size)
    return {"wheels": sha, "documents": len(docs), **count_tokens(docs, out_dir / "tokenizer")}


def count_tokens(docs: list[dict], tokenizer_dir: Path) -> dict:
    """Tokens (EOS after each document, as the training stream joins them) and bytes, per split."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    counts = {"train_tokens": 0, "validation_tokens": 0, "bytes": 0}
    for start in range(0, len(docs), 256):
        batch = [d["text"] for d in docs[start : start + 256]]
        for text, encoding in zip(batch, tokenizer.encode_batch(batch), strict=True):
            split = "validation_tokens" if is_held_out(text) else "train_tokens"
            counts[split] += len(encoding.ids) + (eos is not None)
            counts["bytes"] += len(text.encode())
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--packages",
        default=",".join(PACKAGES),
        help=f"comma-separated subset of {', '.join(PACKAGES)} (a small corpus for a dry run)",
    )
    parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    unknown = sorted(set(packages) - set(PACKAGES))
    if unknown or not packages:
        parser.error(f"--packages: unknown {', '.join(unknown) or '(none given)'}")
    if args.vocab_size < MIN_VOCAB:
        parser.error(f"--vocab_size must be at least {MIN_VOCAB} (the 256 bytes and EOS)")
    out = out_folder(parser, args.out)
    stats = build(out, packages, args.vocab_size)
    (out / "corpus.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
