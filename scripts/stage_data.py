"""Stage a preset's tokenizer and part of its dataset on a shared filesystem, for compute nodes
without internet.

Run once on a machine that can reach the Hub (the login or batch host), into a directory every
node mounts; then train offline from the staged copy:

    python -m scripts.stage_data --preset llama3-8b --out /fsx/stage --documents 2000000
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    sbatch 1.train_llama.sbatch --preset llama3-8b \\
        --tokenizer /fsx/stage/tokenizers/NousResearch--Meta-Llama-3-8B \\
        --dataset /fsx/stage/allenai--c4-en

The dataset is written as gzipped JSON-lines shards (``train-00000-of-00064.jsonl.gz``, ...)
in stream order, with a validation file when the source has a validation split, so train.py
reads it as a local dataset: shards are split between ranks, nothing is downloaded. Every file
is written under a temporary name and renamed when complete, so an interrupted staging never
leaves a file that looks finished; a staging that fails (a bad record, a full disk, Ctrl-C)
removes what it wrote. Input it can check first (the dataset, its text column, --out, the
tokenizer) is refused in one line, exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import runpy
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).with_name("environment_check.py")))
from model_utils import data
from model_utils.config.arguments import UsageError, apply_preset, build_parser
from model_utils.config.flag_rules import value_problem
from model_utils.data.reads import read_error_message
from model_utils.data.sources import document_texts, open_source
from model_utils.errors import OneLineParser, os_error_words, refuse, said
from model_utils.run import outputs

#: Validation documents staged per training document (the source's own validation split), and
#: at least VALIDATION_MIN of them (or the whole split): 1% of a small staging left too few
#: for the validation batches the source itself gave.
VALIDATION_SHARE, VALIDATION_MIN = 0.01, 10_000
PROG = "stage_data.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="train.py preset whose data to stage")
    parser.add_argument("--out", required=True, help="shared directory to write")
    parser.add_argument("--documents", type=int, default=1_000_000, help="training documents")
    parser.add_argument("--shards", type=int, default=64, help="training files (>= ranks)")
    parser.add_argument("--dataset", help="default: the preset's")
    parser.add_argument("--dataset_config_name", help="default: the preset's, for its dataset")
    parser.add_argument("--tokenizer", help="default: the preset's")
    parser.add_argument("--text_column", default="text")
    args = parser.parse_args(argv)
    if not 1 <= args.shards <= args.documents:  # else files named "-of-N" are fewer than N
        raise UsageError(
            "--documents and --shards must be >= 1, and --shards at most --documents, got "
            f"{args.documents}/{args.shards}"
        )
    check_names(args)
    args.out = Path(args.out).expanduser()
    train_argv = [f"--preset={args.preset}"]
    for name in ("dataset", "dataset_config_name", "tokenizer"):
        if getattr(args, name) is not None:
            train_argv.append(f"--{name}={getattr(args, name)}")
    resolved = apply_preset(build_parser().parse_args(train_argv))
    args.dataset, args.tokenizer = resolved.dataset, resolved.tokenizer
    args.dataset_config_name = resolved.dataset_config_name
    return args


def check_names(args: argparse.Namespace) -> None:
    """UsageError for an empty --out or --text_column (an unset shell variable: Path("") is the
    current directory) and for a path with a name over NAME_MAX, which died with ENAMETOOLONG
    in the first look at it; train.py's rules for its own path flags."""
    for flag in ("out", "text_column", "dataset", "tokenizer"):
        value = getattr(args, flag)
        refuse(
            value_problem(f"--{flag}", value, path=flag != "text_column", required=flag == "out")
        )


def slug(dataset: str, config_name: str | None) -> str:
    """A directory name for a dataset: ``allenai/c4`` + ``en`` -> ``allenai--c4-en``."""
    local = Path(dataset).expanduser()
    name = local.resolve().name if local.exists() else dataset  # `.`: the folder's own name
    name = re.sub(r"\.(jsonl|json|txt|parquet)(\.\w+)?$", "", name).replace("/", "--")
    return name + (f"-{config_name}" if config_name else "")


@dataclass
class Plan:
    """What a staging reads and where it writes, found before anything is written."""

    target: Path  # the dataset's folder under --out
    tokenizer_dir: Path
    tokenizer: Any  # None: tokenizer_dir holds it already
    train_texts: Iterator[str]
    validation_texts: Iterator[str] | None


def check_inputs(args: argparse.Namespace) -> Plan:
    """Every check that can refuse the input, before anything is written: the dataset, --out,
    the tokenizer (a folder already staged under its name too). Raises UsageError, ValueError
    (DataError) or OSError."""
    data.check_dataset(args.dataset, args.dataset_config_name)
    data.check_local_data(args.dataset, args.text_column)  # train.py's start-up scan
    data.check_hub_dataset(args.dataset)  # a hub name: one quick look-up, as train.py makes
    target = args.out / slug(args.dataset, args.dataset_config_name)
    tokenizer_dir = args.out / "tokenizers" / slug(args.tokenizer, None)
    check_out(args.out, target, tokenizer_dir)
    tokenizer = data.load_tokenizer(args.tokenizer)
    if tokenizer_staged(tokenizer_dir, tokenizer):
        tokenizer = None
    train_texts, validation_texts = open_documents(args)
    return Plan(target, tokenizer_dir, tokenizer, train_texts, validation_texts)


def check_out(out: Path, target: Path, tokenizer_dir: Path) -> None:
    """UsageError if a file is in the way of a folder the staging makes, the dataset is staged
    there already, or --out cannot be written: looked at, then written to and cleaned as
    train.py probes its outputs (a root-owned /sys passes access() and failed at mkdir)."""
    for folder in (target, tokenizer_dir.parent, tokenizer_dir):
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{folder} is a file, not a folder: move it or choose another --out")
    if target.exists() and any(target.iterdir()):
        raise UsageError(
            f"{target} already holds a staged dataset; remove it or choose another --out"
        )
    refuse(outputs.location_problem("--out", out) or outputs.probe_write("--out", out))


def open_documents(args: argparse.Namespace) -> tuple[Iterator[str], Iterator[str] | None]:
    """The training and validation documents. The first is read now: hub data is not scanned
    at start-up, and a wrong --text_column shows at its first record."""
    source = open_source(args.dataset, args.dataset_config_name, args.text_column)
    train = read_checked(source.train, args, source)
    first = next(train, None)
    if first is None:
        raise UsageError(f"--dataset {args.dataset} holds no document in {args.text_column!r}")
    validation = source.validation
    if validation is not None:
        validation = read_checked(validation, args, source)
    return chain([first], train), validation


def tokenizer_staged(folder: Path, tokenizer: Any) -> bool:
    """Whether `folder` holds this tokenizer already (staged with another dataset): then it is
    not written again, so an interrupted staging cannot half-write it. UsageError if it holds
    another tokenizer of the same name, which a dataset staged earlier may train with."""
    if not folder.exists():
        return False
    try:
        staged = data.tokenizer_fingerprint(data.load_tokenizer(str(folder)))
    except ValueError:
        staged = None
    if staged == data.tokenizer_fingerprint(tokenizer):
        return True
    raise UsageError(
        f"{folder} holds another tokenizer (staged earlier from another --tokenizer of that "
        "name): remove it, or choose another --out"
    )


def read_checked(examples: Iterable[dict], args: argparse.Namespace, source: Any) -> Iterator[str]:
    """The documents of `examples`; a read that fails (a wrong column, a bad byte past the
    start-up scan, a file gone) is a DataError with train.py's one line for it, so a reading
    problem is never reported as one of writing."""
    try:
        yield from document_texts(iter(examples), args.text_column, source)
    except (ValueError, OSError) as exc:
        line = read_error_message(exc, args.dataset, args.text_column, 0, "when staged")
        raise data.DataError(line) from exc


def write_shard(path: Path, texts: Iterable[str], text_column: str) -> int:
    """Write ``texts`` as one gzipped JSON-lines file, atomically; returns the count."""
    partial = path.with_name(path.name + ".partial")
    count = 0
    with gzip.open(partial, "wt", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({text_column: text}, ensure_ascii=False) + "\n")
            count += 1
    os.replace(partial, path)
    return count


def stage_dataset(args: argparse.Namespace, plan: Plan) -> tuple[int, int]:
    """(training, validation) documents written under ``plan.target``. Each file's documents
    are read before it is opened, so a failed read never leaves a half-written shard."""
    written, (per_shard, rest) = 0, divmod(args.documents, args.shards)  # as even as can be
    for index in range(args.shards):
        chunk = list(islice(plan.train_texts, per_shard + (index < rest)))
        if not chunk:
            break
        name = f"train-{index:05d}-of-{args.shards:05d}.jsonl.gz"
        written += write_shard(plan.target / name, chunk, args.text_column)
    validation = 0
    if plan.validation_texts is not None:
        wanted = max(VALIDATION_MIN, int(args.documents * VALIDATION_SHARE))
        chunk = list(islice(plan.validation_texts, wanted))
        validation = write_shard(plan.target / "validation-00000.jsonl.gz", chunk, args.text_column)
    return written, validation


def stage(args: argparse.Namespace, plan: Plan) -> tuple[int, int]:
    """Write the dataset, then the tokenizer. If anything fails (a bad record past the scan, a
    full disk, Ctrl-C), what this staging wrote is removed before the exception goes on: the
    folders it created, and the files in a dataset folder that was empty, so a second try is
    not refused as 'already holds a staged dataset'. A tokenizer folder that existed is never
    written (tokenizer_staged)."""
    # The outermost folder each would create: --out's, or one folder of its own inside --out.
    missing = [outputs.missing_folders(p) for p in (plan.target, plan.tokenizer_dir)]
    created = {folders[-1] for folders in missing if folders}
    try:
        plan.target.mkdir(parents=True, exist_ok=True)
        counts = stage_dataset(args, plan)
        if plan.tokenizer is not None:
            plan.tokenizer.save_pretrained(str(plan.tokenizer_dir))
        return counts
    except BaseException:
        for folder in created:
            shutil.rmtree(folder, ignore_errors=True)
        if plan.target.is_dir():  # it existed, empty: all in it is this staging's
            for file in plan.target.iterdir():
                file.unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:
        return said(PROG, "interrupted; what this staging wrote is removed", 130)


def run(argv: list[str] | None) -> int:
    """Check, then stage; the exit status."""
    try:
        args = parse_args(argv)
        plan = check_inputs(args)
    except (UsageError, ValueError) as exc:
        return said(PROG, str(exc))
    except OSError as exc:  # a folder it may not list, a file it may not read
        return said(PROG, f"{exc.filename}: {os_error_words(exc)}")
    try:
        train_docs, val_docs = stage(args, plan)
    except ValueError as exc:
        return said(PROG, f"{exc} (what this staging wrote is removed)")
    except OSError as exc:
        return said(
            PROG, f"{outputs.unwritable('--out', args.out, exc)} (what was written is removed)", 1
        )
    print(f"staged {train_docs} training and {val_docs} validation documents in {plan.target}")
    print(f"tokenizer in {plan.tokenizer_dir}; train offline with:")
    print("  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")
    print(f"  ... --tokenizer {plan.tokenizer_dir} --dataset {plan.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
