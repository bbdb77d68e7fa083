"""Where documents come from: a hub name or a local file/folder, opened as a streaming dataset,
split into this rank's disjoint part, and read as non-empty texts.

A local corpus goes through the same `datasets.IterableDataset` path as C4, so the bundled
corpus tests the code a cluster run uses.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from model_utils.errors import Refusal, UsageError

if TYPE_CHECKING:  # imported lazily at run time: datasets is slow to import
    from datasets import IterableDataset

HELD_OUT_FRACTION = 0.05  # share of documents kept for validation when there is no such split

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
VALIDATION_NAME = re.compile(r"(^|[^a-z0-9])(validation|valid|val|dev)([^a-z0-9]|$)")
TEST_NAME = re.compile(r"(^|[^a-z0-9])test([^a-z0-9]|$)")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class DataError(Refusal, ValueError):
    """The data cannot be used: one line naming the file (and line or row) and what to do."""


@dataclass(frozen=True)
class Source:
    """A dataset opened for streaming: its training part and its validation split, if any."""

    name: str
    train: IterableDataset
    validation: IterableDataset | None
    strip: bool = False  # .txt paragraphs keep their line breaks, including a trailing one


def looks_like_path(name: str) -> bool:
    """Whether a name that does not exist was meant as a local path (a typo, not a hub name)."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.count("/") > 1
        or builder_for(Path(name)) is not None
    )


def builder_for(path: Path) -> str | None:
    """The `datasets` packaged builder for a file name, looking through compression suffixes."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def local_files(path: Path) -> tuple[str, list[str], list[str]]:
    """(builder, training files, validation files) of a local file or folder.

    In a folder, files whose path names a validation split are the validation part, `test`
    files are left out, hidden files are ignored, and all files must share one format.
    """
    if path.is_file():
        builder = builder_for(path)
        if builder is None:
            raise UsageError(
                f"--dataset {path}: unsupported file type (use {', '.join(BUILDERS)}, "
                f"optionally compressed with {', '.join(COMPRESSIONS)})"
            )
        return builder, [str(path)], []
    files = sorted(p for p in folder_files(path) if builder_for(p) is not None)
    if not files:
        raise UsageError(f"--dataset {path}: no {'/'.join(BUILDERS)} files in this folder")
    builders = {builder_for(p) for p in files}
    if len(builders) > 1:  # one file of each format, so the user sees which to move away
        each = {builder_for(p): p.relative_to(path) for p in reversed(files)}
        named = ", ".join(f"{b} ({each[b]})" for b in sorted(builders))
        raise UsageError(f"--dataset {path}: mixes file formats: {named}; keep one in the folder")
    train, validation = [], []
    for file in files:
        relative = str(file.relative_to(path)).lower()
        if VALIDATION_NAME.search(relative):
            validation.append(str(file))
        elif not TEST_NAME.search(relative):
            train.append(str(file))
    if not train:
        raise UsageError(f"--dataset {path}: no training files (only validation/test ones)")
    return builders.pop(), train, validation


def folder_files(folder: Path) -> list[Path]:
    """Every non-hidden file under a folder, through symlinked subfolders (`ln -s` is how data
    on shared storage gets staged, and `Path.rglob` does not follow them); a dangling link is
    refused rather than skipped, since its data would silently be missing from the run."""
    found, visited = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in visited:  # a link back up the tree: read each folder once
            dirs.clear()
            continue
        visited.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            file = Path(root) / name
            if file.is_symlink() and not file.exists():
                raise UsageError(
                    f"--dataset {folder}: {file} is a broken symbolic link (to "
                    f"{os.readlink(file)}): restore its target or remove the link"
                )
            if file.is_file():
                found.append(file)
    return found


def check_dataset(dataset: str, config_name: str | None) -> None:
    """Cheap argument check (no network): a local path must exist and hold supported files."""
    if not dataset:
        raise UsageError("--dataset is empty: give a hub dataset name or a local file/folder")
    path = Path(dataset).expanduser()
    if path.exists():
        if config_name:
            raise UsageError(
                f"--dataset_config_name {config_name} applies to hub datasets only, "
                f"but --dataset {dataset} is a local path"
            )
        local_files(path)
    elif looks_like_path(dataset) or not HUB_NAME.match(dataset):
        raise UsageError(f"--dataset {dataset}: no such file or directory")


def open_source(dataset: str, config_name: str | None, text_column: str) -> Source:
    """Open a hub or local dataset as streaming IterableDatasets (no download, no Arrow cache).

    Local JSON and parquet data are read as `text_column` alone: the datasets library casts
    every record to the columns and types of the first file, and other columns changing
    between files stopped runs mid-way (see local_json.py)."""
    from datasets import load_dataset

    check_dataset(dataset, config_name)
    path = Path(dataset).expanduser()
    if path.exists():
        builder, train, validation = local_files(path)
        data_files = {"train": train, **({"validation": validation} if validation else {})}
        if builder == "json":
            from model_utils.data.local_json import open_text_json

            splits = open_text_json(data_files, text_column)
        else:
            options = {
                "text": {"sample_by": "paragraph", "keep_linebreaks": True},
                "parquet": {"columns": [text_column]},
            }[builder]
            splits = load_dataset(builder, data_files=data_files, streaming=True, **options)
    else:
        try:
            splits = load_dataset(dataset, config_name, streaming=True)
        except (FileNotFoundError, ConnectionError) as error:  # unknown name, no network
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise UsageError(f"--dataset {dataset}: cannot be opened ({reason})") from error
        if "train" not in splits:
            raise UsageError(f"--dataset {dataset} has no 'train' split (it has {list(splits)})")
        builder = None
    return Source(dataset, splits["train"], splits.get("validation"), strip=builder == "text")


def rank_view(
    base: IterableDataset, rank: int, world_size: int, shard_order: int
) -> IterableDataset:
    """This rank's disjoint part of `base`, with shard order `shard_order` (0 = file order)."""
    from datasets.distributed import split_dataset_by_node

    view = split_dataset_by_node(base, rank=rank, world_size=world_size)
    view.set_epoch(shard_order)  # datasets shuffles the shard order with this value as the seed
    return view


def epoch_shard_order(seed: int, epoch: int) -> int:
    """A positive per-(seed, epoch) value for `set_epoch`; identical on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]) + 1


def document_texts(examples: Iterator[dict], text_column: str, source: Source) -> Iterator[str]:
    """Non-empty document texts of a stream of examples, with a clear error for a wrong column."""
    for example in examples:
        if text_column not in example:
            fix = "pass --text_column"
            if source.strip:  # the text builder: one column, its blank-line-separated paragraphs
                fix = "a .txt file has only that one: drop --text_column"
            raise DataError(
                f"--dataset {source.name} has no column {text_column!r} (columns: "
                f"{', '.join(example)}): {fix}"
            )
        text = example[text_column]
        if text is not None and not isinstance(text, str):
            raise DataError(not_text_message(f"--dataset {source.name}", text_column, text))
        if text and source.strip:
            text = text.strip()
        if text:
            yield text


def not_text_message(where: str, text_column: str, value: object) -> str:
    """The line for a record whose text column holds a number, list, ... instead of a string
    (null is an empty document). Tokenising it would fail inside the tokenizer or the
    held-out hash, as a traceback."""
    kind = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    what = kind.get(type(value), f"a {type(value).__name__}")
    return (
        f"{where}: column {text_column!r} holds {what} ({str(value)[:40]!r}), not text: fix the "
        "record, or pass the --text_column that holds the documents"
    )


def is_held_out(text: str) -> bool:
    """Whether a document belongs to the validation part (used when there is no such split).

    A hash of the text, not a position: stable across seeds, world sizes and file orders.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 10_000 < HELD_OUT_FRACTION * 10_000


def require_positive(**values: int) -> None:
    """ValueError naming the first size below 1 (a zero would loop forever or divide by zero)."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
