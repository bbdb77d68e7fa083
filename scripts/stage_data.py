"""Stage a preset's tokenizer and part of its dataset on a shared filesystem, for compute nodes
without internet.

Run once on a machine that can reach the Hub (the login or batch host), into a directory every
node mounts; then train offline from the staged copy:

    python scripts/stage_data.py --preset llama3-8b --out /fsx/stage --documents 2000000
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    sbatch 1.train_llama.sbatch --preset llama3-8b \\
        --tokenizer /fsx/stage/tokenizers/NousResearch--Meta-Llama-3-8B \\
        --dataset /fsx/stage/allenai--c4-en

The dataset is written as gzipped JSON-lines shards (``train-00000-of-00064.jsonl.gz``, ...)
in stream order, with a validation file when the source has a validation split, so train.py
reads it as a local dataset: shards are split between ranks, nothing is downloaded. Every file
is written under a temporary name and renamed when complete, so an interrupted staging never
leaves a file that looks finished.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_utils import data  # noqa: E402
from model_utils.arguments import UsageError, apply_preset, build_parser  # noqa: E402

#: Validation documents staged per training document (the source's own validation split).
VALIDATION_SHARE = 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="train.py preset whose data to stage")
    parser.add_argument("--out", type=Path, required=True, help="shared directory to write")
    parser.add_argument("--documents", type=int, default=1_000_000, help="training documents")
    parser.add_argument("--shards", type=int, default=64, help="training files (>= ranks)")
    parser.add_argument("--dataset", help="default: the preset's")
    parser.add_argument("--dataset_config_name", help="default: the preset's, for its dataset")
    parser.add_argument("--tokenizer", help="default: the preset's")
    parser.add_argument("--text_column", default="text")
    args = parser.parse_args(argv)
    if args.documents < 1 or args.shards < 1:
        raise UsageError(
            f"--documents and --shards must be >= 1, got {args.documents}/{args.shards}"
        )
    train_argv = [f"--preset={args.preset}"]
    for name in ("dataset", "dataset_config_name", "tokenizer"):
        if getattr(args, name) is not None:
            train_argv.append(f"--{name}={getattr(args, name)}")
    resolved = apply_preset(build_parser().parse_args(train_argv))
    args.dataset, args.tokenizer = resolved.dataset, resolved.tokenizer
    args.dataset_config_name = resolved.dataset_config_name
    return args


def slug(dataset: str, config_name: str | None) -> str:
    """A directory name for a dataset: ``allenai/c4`` + ``en`` -> ``allenai--c4-en``."""
    name = Path(dataset).name if Path(dataset).expanduser().exists() else dataset
    name = re.sub(r"\.(jsonl|json|txt|parquet)(\.\w+)?$", "", name).replace("/", "--")
    return name + (f"-{config_name}" if config_name else "")


def write_shard(path: Path, texts: Iterator[str], text_column: str) -> int:
    """Write ``texts`` as one gzipped JSON-lines file, atomically; returns the count."""
    partial = path.with_name(path.name + ".partial")
    count = 0
    with gzip.open(partial, "wt", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({text_column: text}, ensure_ascii=False) + "\n")
            count += 1
    os.replace(partial, path)
    return count


def stage_dataset(args: argparse.Namespace, target: Path) -> tuple[int, int]:
    """(training, validation) documents written under ``target``."""
    source = data.open_source(args.dataset, args.dataset_config_name)
    texts = data.document_texts(iter(source.train), args.text_column, source)
    per_shard = -(-args.documents // args.shards)
    written = 0
    for index in range(args.shards):
        chunk = list(islice(texts, min(per_shard, args.documents - written)))
        if not chunk:
            break
        name = f"train-{index:05d}-of-{args.shards:05d}.jsonl.gz"
        written += write_shard(target / name, iter(chunk), args.text_column)
    validation = 0
    if source.validation is not None:
        val_texts = data.document_texts(iter(source.validation), args.text_column, source)
        wanted = max(1, int(args.documents * VALIDATION_SHARE))
        validation = write_shard(
            target / "validation-00000.jsonl.gz", islice(val_texts, wanted), args.text_column
        )
    return written, validation


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        data.check_dataset(args.dataset, args.dataset_config_name)
        target = args.out.expanduser() / slug(args.dataset, args.dataset_config_name)
        if target.exists() and any(target.iterdir()):
            raise UsageError(
                f"{target} already holds a staged dataset; remove it or choose another --out"
            )
        tokenizer = data.load_tokenizer(args.tokenizer)
    except (UsageError, ValueError) as exc:
        print(f"stage_data.py: error: {exc}", file=sys.stderr)
        return 2
    target.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.out.expanduser() / "tokenizers" / slug(args.tokenizer, None)
    tokenizer.save_pretrained(str(tokenizer_dir))
    train_docs, val_docs = stage_dataset(args, target)
    print(f"staged {train_docs} training and {val_docs} validation documents in {target}")
    print(f"tokenizer in {tokenizer_dir}; train offline with:")
    print("  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")
    print(f"  ... --tokenizer {tokenizer_dir} --dataset {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
