"""Text dataset -> tokens -> packed windows -> this rank's micro-batches, with a resumable position.

The pipeline, and why it is built this way:

* Source. A Hugging Face hub dataset (streamed, never downloaded whole) or a local file/folder of
  .txt/.json/.jsonl/.parquet (optionally compressed), both read as a `datasets.IterableDataset`,
  so the bundled corpus exercises the same code path as C4. `.txt` files yield one document per
  paragraph (blank-line separated).
* Validation. The dataset's own `validation` split when it has one (hub datasets; local folders
  with files named like `validation`/`valid`/`val`/`dev`). Otherwise a fixed 5% of documents,
  chosen by a hash of the text (`is_held_out`): the same documents every run, whatever the seed,
  rank count or file order, and never in training. Exact duplicates land on the same side.
* Rank shards. `datasets.distributed.split_dataset_by_node` (whole files per rank when the file
  count divides the world size, otherwise every world_size-th document): disjoint by design.
* Order. Per epoch, the shard order is shuffled (`IterableDataset.set_epoch` with a key derived
  from seed and epoch), and documents are read in blocks of `block_docs` that are permuted with
  a generator seeded by (seed, epoch, block). Deterministic for a seed, and - unlike a datasets
  shuffle buffer, whose content is lost on resume - exactly reproducible after a restore.
* Tokens. The fast tokenizer encodes `tokenize_batch` documents per call (Rust, batched); EOS is
  appended after every document and everything is concatenated. Windows of exactly `seq_len`
  tokens are cut back to back from that stream: no token is dropped or repeated, and the stream
  carries over epoch boundaries (the tail of one epoch starts the next batch).
* Position. `TrainStream.state_dict()` holds a few integers and the datasets state of the current
  block's start (a JSON string): epoch, block, first document of the current tokenizer batch and
  tokens already emitted from it. Restoring re-reads one block of raw text from that state and
  re-tokenises one tokenizer batch; nothing before the block is read or tokenised again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model_utils.arguments import first_line

if TYPE_CHECKING:  # imported lazily at run time: transformers/datasets are slow to import
    from datasets import IterableDataset
    from transformers import PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_DATASET = str(DATA_DIR / "kjv.jsonl.gz")
DEFAULT_TOKENIZER = str(DATA_DIR / "tokenizer")

HELD_OUT_FRACTION = 0.05  # share of documents kept for validation when there is no such split
BLOCK_DOCS = 1024  # documents read and permuted together (the shuffle window)
TOKENIZE_BATCH = 64  # documents per tokenizer call (also the re-tokenisation cost of a resume)

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
VALIDATION_NAME = re.compile(r"(^|[^a-z0-9])(validation|valid|val|dev)([^a-z0-9]|$)")
TEST_NAME = re.compile(r"(^|[^a-z0-9])test([^a-z0-9]|$)")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

Batch = dict[str, torch.Tensor]

# What the start-up check reads of local data: enough to find a bad file at once, not a whole
# corpus (a bad byte further in is met mid-run and named then).
SCAN_BYTES_PER_FILE = 8 * 2**20
SCAN_BYTES_TOTAL = 64 * 2**20
HUB_TIMEOUT_S = 10.0  # one look-up of a hub dataset name before anything starts


class DataError(ValueError):
    """The data cannot be used: one line naming the file (and line or row) and what to do."""


# --------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer (hub name or local directory); it must define an EOS token."""
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if not path.exists() and _looks_like_path(name_or_path):
        raise ValueError(f"--tokenizer {name_or_path}: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name_or_path)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--tokenizer {name_or_path}: cannot be loaded ({reason})") from error
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {name_or_path} has no EOS token, which is needed between documents"
        )
    return tokenizer


def check_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Fail early, in one line, when token ids would overflow the model's embedding table."""
    needed = len(tokenizer)
    if needed > vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path} has {needed} tokens but the model's vocab_size is "
            f"{vocab_size}: pass --vocab_size {needed} (or more), or use a tokenizer with at most "
            f"{vocab_size} tokens"
        )


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> np.ndarray:
    """Token ids of each text followed by EOS, concatenated (int64).

    One batched call into the Rust tokenizer, with no truncation and no special tokens other than
    the EOS separator; this is the only place the pipeline tokenises.
    """
    eos = tokenizer.eos_token_id
    if not texts:
        return np.empty(0, dtype=np.int64)
    if tokenizer.is_fast:
        encodings = _backend(tokenizer).encode_batch_fast(texts, add_special_tokens=False)
        documents = [encoding.ids for encoding in encodings]
    else:  # slow (Python) tokenizers still work, just slower
        documents = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)[
            "input_ids"
        ]
    separator = np.array([eos], dtype=np.int64)
    pieces = []
    for ids in documents:  # one C-level list->array copy per document, then one concatenation
        pieces.append(np.array(ids, dtype=np.int64))
        pieces.append(separator)
    return np.concatenate(pieces)


_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """A private copy of the Rust tokenizer with truncation and padding off, one per tokenizer.

    A copy, because transformers changes the backend's truncation/padding settings per call and
    a hub tokenizer.json may ship with truncation enabled, which would silently cut documents.
    """
    backend = _BACKENDS.get(tokenizer)
    if backend is None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        _BACKENDS[tokenizer] = backend
    return backend


# --------------------------------------------------------------------------------------------
# Dataset sources


def check_dataset(dataset: str, config_name: str | None) -> None:
    """Cheap argument check (no network): a local path must exist and hold supported files."""
    if not dataset:
        raise ValueError("--dataset is empty: give a hub dataset name or a local file/folder")
    path = Path(dataset).expanduser()
    if path.exists():
        if config_name:
            raise ValueError(
                f"--dataset_config_name {config_name} applies to hub datasets only, "
                f"but --dataset {dataset} is a local path"
            )
        _local_files(path)
    elif _looks_like_path(dataset) or not HUB_NAME.match(dataset):
        raise ValueError(f"--dataset {dataset}: no such file or directory")


def check_hub_dataset(dataset: str, timeout: float = HUB_TIMEOUT_S) -> None:
    """One quick look-up of a name that is not a local path, before anything starts: a typo'd
    local name (`corpus` for `corpus.jsonl`) or a machine without network otherwise spends half
    a minute in the datasets library's retries, after the model is built. Streaming a hub
    dataset needs the network anyway, so an offline setting is refused too."""
    if Path(dataset).expanduser().exists():
        return
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if _env_true(v)]
    local_hint = "give a local file with its extension (.jsonl, .txt, .parquet) or folder"
    if offline:
        raise DataError(
            f"--dataset {dataset}: no local file or folder of that name, and hub look-ups are "
            f"off ({offline[0]}=1; streaming a hub dataset needs the network): {local_hint}"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().dataset_info(dataset, timeout=timeout)
    except RepositoryNotFoundError:
        raise DataError(
            f"--dataset {dataset}: no local file or folder of that name, and no such dataset on "
            f"the Hugging Face hub (or it is private: set HF_TOKEN): {local_hint}"
        ) from None
    except Exception as exc:  # no network, DNS, proxy, timeout, server error
        raise DataError(
            f"--dataset {dataset}: no local file or folder of that name, and the Hugging Face hub "
            f"did not answer within {timeout:g} s ({first_line(exc)}): {local_hint}, or check "
            "the network"
        ) from None


def _env_true(name: str) -> bool:
    import os

    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def check_local_data(dataset: str, text_column: str) -> None:
    """Before the model is built: every local data file is non-empty and readable, and the first
    SCAN_BYTES_PER_FILE of each (SCAN_BYTES_TOTAL in all) decode as UTF-8, parse (JSON lines),
    and hold `text_column`. DataError names the file, and the line or what is missing."""
    path = Path(dataset).expanduser()
    if not path.exists():
        return
    builder, train, validation = _local_files(path)
    budget = SCAN_BYTES_TOTAL
    for name in train + validation:
        file = Path(name)
        if file.stat().st_size == 0:
            raise DataError(f"--dataset: {file} is empty: remove it or fill it")
        if builder == "parquet":
            _check_parquet(file, text_column)
            continue
        budget -= _scan_file(file, builder, text_column, min(SCAN_BYTES_PER_FILE, budget))
        if budget <= 0:
            break


def find_bad_file(dataset: str, text_column: str) -> str | None:
    """The one-line problem of the first local data file that fails the start-up checks read
    in full (what a rank met mid-run, beyond the start-up scan), or None (hub data, or no file
    shows it)."""
    path = Path(dataset).expanduser()
    if not path.exists():
        return None
    builder, train, validation = _local_files(path)
    for name in train + validation:
        try:
            if builder == "parquet":
                _check_parquet(Path(name), text_column)
            else:
                _scan_file(Path(name), builder, text_column, limit=None)
        except DataError as exc:
            return str(exc)
    return None


def _check_parquet(file: Path, text_column: str) -> None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file).metadata
    except Exception as exc:
        raise DataError(
            f"--dataset: {file} is not a readable parquet file ({first_line(exc)}): replace or "
            "remove it"
        ) from None
    names = meta.schema.to_arrow_schema().names
    if text_column not in names:
        raise DataError(
            f"--dataset: {file} has no column {text_column!r} (columns: {', '.join(names)}): pass "
            "--text_column"
        )
    if meta.num_rows == 0:
        raise DataError(f"--dataset: {file} has no rows: remove it or fill it")


def _open_binary(file: Path) -> Any | None:
    """`file` opened for reading its decompressed bytes (None for .zst/.lz4: the datasets
    library reads those itself)."""
    import bz2
    import gzip
    import lzma

    openers = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    suffix = file.suffix.lower()
    if suffix in COMPRESSIONS and suffix not in openers:
        return None
    return openers.get(suffix, open)(file, "rb")


def _scan_file(file: Path, builder: str, column: str, limit: int | None) -> int:
    """Read `file` line by line (up to about `limit` decompressed bytes; None: all of it): each
    line must be UTF-8 and, in JSON lines, a JSON object; the first record must hold `column`.
    DataError names the file and line. Returns the bytes read."""
    handle = _open_binary(file)
    if handle is None:
        return 0
    read, has_text, json_lines, seen_column, cut = 0, False, None, False, False
    try:
        with handle:
            for number, raw in enumerate(handle, start=1):
                if limit is not None and read + len(raw) > limit:
                    cut = True  # the scan ends here; a line cut by it is not judged
                    break
                read += len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"--dataset: {file} line {number} is not UTF-8 text (byte "
                        f"0x{raw[exc.start]:02x}): convert the file to UTF-8, or remove it"
                    ) from None
                if not line.strip():
                    continue
                has_text = True
                if builder != "json":
                    continue
                if json_lines is None:  # a .json file may be one JSON document instead
                    json_lines = ".jsonl" in [x.lower() for x in file.suffixes] or _is_object(line)
                if not json_lines:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"--dataset: {file} line {number} is not JSON ({exc.msg}): fix or "
                        "remove the line"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(f"--dataset: {file} line {number} is not a JSON object")
                if not seen_column and column not in record:
                    raise DataError(
                        f"--dataset: {file} line {number} has no column {column!r} (columns: "
                        f"{', '.join(record)}): pass --text_column"
                    )
                seen_column = True
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"--dataset: {file} cannot be read or decompressed ({first_line(exc)}): replace or "
            "remove it"
        ) from None
    if not has_text and not cut:
        raise DataError(f"--dataset: {file} holds no text: remove it or fill it")
    return read


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def is_held_out(text: str) -> bool:
    """Whether a document belongs to the validation part (used when there is no such split).

    A hash of the text, not a position: stable across seeds, world sizes and file orders.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 10_000 < HELD_OUT_FRACTION * 10_000


@dataclass(frozen=True)
class _Source:
    """A dataset opened for streaming: its training part and its validation split, if any."""

    name: str
    train: IterableDataset
    validation: IterableDataset | None
    strip: bool = False  # .txt paragraphs keep their line breaks, including a trailing one


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.count("/") > 1
        or _builder_for(Path(name)) is not None
    )


def _builder_for(path: Path) -> str | None:
    """The `datasets` packaged builder for a file name, looking through compression suffixes."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _local_files(path: Path) -> tuple[str, list[str], list[str]]:
    """(builder, training files, validation files) of a local file or folder.

    In a folder, files whose path names a validation split are the validation part, `test`
    files are left out, hidden files are ignored, and all files must share one format.
    """
    if path.is_file():
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(
                f"--dataset {path}: unsupported file type (use {', '.join(BUILDERS)}, "
                f"optionally compressed with {', '.join(COMPRESSIONS)})"
            )
        return builder, [str(path)], []
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and _builder_for(p) is not None
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"--dataset {path}: no {'/'.join(BUILDERS)} files in this folder")
    builders = {_builder_for(p) for p in files}
    if len(builders) > 1:
        raise ValueError(f"--dataset {path}: mixes file formats ({', '.join(sorted(builders))})")
    train, validation = [], []
    for file in files:
        relative = str(file.relative_to(path)).lower()
        if VALIDATION_NAME.search(relative):
            validation.append(str(file))
        elif not TEST_NAME.search(relative):
            train.append(str(file))
    if not train:
        raise ValueError(f"--dataset {path}: no training files (only validation/test ones)")
    return builders.pop(), train, validation


def _open(dataset: str, config_name: str | None) -> _Source:
    """Open a hub or local dataset as streaming IterableDatasets (no download, no Arrow cache)."""
    from datasets import load_dataset

    check_dataset(dataset, config_name)
    path = Path(dataset).expanduser()
    if path.exists():
        builder, train, validation = _local_files(path)
        data_files = {"train": train, **({"validation": validation} if validation else {})}
        options = {"sample_by": "paragraph", "keep_linebreaks": True} if builder == "text" else {}
        splits = load_dataset(builder, data_files=data_files, streaming=True, **options)
    else:
        try:
            splits = load_dataset(dataset, config_name, streaming=True)
        except (FileNotFoundError, ConnectionError) as error:  # unknown name, no network
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise ValueError(f"--dataset {dataset}: cannot be opened ({reason})") from error
        if "train" not in splits:
            raise ValueError(f"--dataset {dataset} has no 'train' split (it has {list(splits)})")
        builder = None
    return _Source(dataset, splits["train"], splits.get("validation"), strip=builder == "text")


def _rank_view(
    base: IterableDataset, rank: int, world_size: int, shard_order: int
) -> IterableDataset:
    """This rank's disjoint part of `base`, with shard order `shard_order` (0 = file order)."""
    from datasets.distributed import split_dataset_by_node

    view = split_dataset_by_node(base, rank=rank, world_size=world_size)
    view.set_epoch(shard_order)  # datasets shuffles the shard order with this value as the seed
    return view


def _shard_order(seed: int, epoch: int) -> int:
    """A positive per-(seed, epoch) value for `set_epoch`; identical on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]) + 1


def _texts(examples: Iterator[dict], text_column: str, source: _Source) -> Iterator[str]:
    """Non-empty document texts of a stream of examples, with a clear error for a wrong column."""
    for example in examples:
        if text_column not in example:
            raise DataError(
                f"--dataset {source.name} has no column {text_column!r} (columns: "
                f"{', '.join(example)}): pass --text_column"
            )
        text = example[text_column]
        if text and source.strip:
            text = text.strip()
        if text:
            yield text


# --------------------------------------------------------------------------------------------
# Training stream


class _BlockReader:
    """This rank's training documents of one epoch, read block by block in shuffled order."""

    def __init__(
        self,
        source: _Source,
        text_column: str,
        rank: int,
        world_size: int,
        seed: int,
        block_docs: int,
    ) -> None:
        self.source = source
        self.text_column = text_column
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.block_docs = block_docs
        # Held-out documents are filtered out only when validation comes from the training part.
        self.skip_held_out = source.validation is None
        self.epoch = 0
        self._view: IterableDataset | None = None
        self._documents: Iterator[str] = iter(())

    def open(self, epoch: int, dataset_state: str = "") -> None:
        """Start reading `epoch`, at the start or at a block start saved by `position()`."""
        self.epoch = epoch
        self._view = _rank_view(
            self.source.train, self.rank, self.world_size, _shard_order(self.seed, epoch)
        )
        if dataset_state:
            self._view.load_state_dict(json.loads(dataset_state))
        texts = _texts(iter(self._view), self.text_column, self.source)
        self._documents = (t for t in texts if not (self.skip_held_out and is_held_out(t)))

    def position(self) -> str:
        """The datasets state after the documents read so far (JSON, "" before any read)."""
        state = self._view.state_dict() if self._view is not None else None
        return json.dumps(state) if state else ""

    def read_block(self, block: int) -> list[str]:
        """The next `block_docs` documents (fewer at the end), permuted by (seed, epoch, block)."""
        texts: list[str] = []
        for text in self._documents:
            texts.append(text)
            if len(texts) == self.block_docs:
                break
        order = np.random.default_rng([self.seed, self.epoch, block]).permutation(len(texts))
        return [texts[i] for i in order]

    def empty_message(self) -> str:
        return (
            f"--dataset {self.source.name}: rank {self.rank} of {self.world_size} has no training "
            f"documents (dataset too small, or all documents are empty or held out)"
        )


@dataclass
class _Cursor:
    """Where the next token comes from (everything needed to resume, nothing else)."""

    epoch: int = 0
    block: int = 0  # index of the block within the epoch
    # JSON of the rank view's IterableDataset.state_dict() at the block start; "" = epoch start
    dataset_state: str = ""
    doc: int = 0  # first document (in the block's shuffled order) of the current tokenizer batch
    token: int = 0  # tokens of that tokenizer batch already emitted


class TrainStream:
    """Endless iterator over this rank's training micro-batches: {input_ids, labels}, each a
    LongTensor [micro_batch, seq_len].

    labels == input_ids: Hugging Face causal LMs shift them internally. When the training part is
    exhausted a new epoch starts, reshuffled deterministically from (seed, epoch).

    `state_dict()` returns {f"rank{rank}": {...}}: fixed keys holding ints and strings, under a
    key that names the rank, so that torch.distributed.checkpoint saves every rank's position
    (DCP keeps one copy of identical keys across ranks) and a fresh stream's state_dict() is a
    valid load template. The object follows DCP's Stateful protocol and can be put in the
    checkpoint's state dict as is. A checkpoint from another world size: `restart_after_reshard`.
    """

    def __init__(
        self,
        dataset: str,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        micro_batch: int,
        *,
        config_name: str | None = None,
        text_column: str = "text",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        block_docs: int = BLOCK_DOCS,
        tokenize_batch: int = TOKENIZE_BATCH,
    ) -> None:
        _require_positive(seq_len=seq_len, micro_batch=micro_batch, world_size=world_size)
        _require_positive(block_docs=block_docs, tokenize_batch=tokenize_batch)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.text_column = text_column
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.block_docs = block_docs
        self.tokenize_batch = tokenize_batch
        source = _open(dataset, config_name)
        self._reader = _BlockReader(source, text_column, rank, world_size, seed, block_docs)
        self._cursor = _Cursor()
        self._block: list[str] = []  # texts of the current block, shuffled
        self._tokens: np.ndarray | None = None  # tokens of the current tokenizer batch
        self.batches = 0  # micro-batches yielded so far (restored by load_state_dict)
        self._epoch_tokens = 0  # tokens encoded since the epoch started (for the tiny-data warning)
        self._warned_tiny = False

    @property
    def epoch(self) -> int:
        """Epoch of the next token (0-based)."""
        return self._cursor.epoch

    def __iter__(self) -> TrainStream:
        return self

    def __next__(self) -> Batch:
        tokens = self._take(self.micro_batch * self.seq_len)
        input_ids = torch.from_numpy(tokens).view(self.micro_batch, self.seq_len)
        self.batches += 1
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    # -- position ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's position: small, plain, and the same keys before and after iterating."""
        state = {
            "dataset": _dataset_id(self.dataset),
            "seed": self.seed,
            "world_size": self.world_size,
            "block_docs": self.block_docs,
            "tokenize_batch": self.tokenize_batch,
            "batches": self.batches,
            **asdict(self._cursor),
        }
        return {f"rank{self.rank}": state}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Resume at a saved position; the next batch is the one the saved run would have yielded.

        Only a state saved by the same rank of a run with the same world size, dataset, seed and
        block sizes fits; anything else is a ValueError (see `restart_after_reshard`).
        """
        saved = self._own_entry(state)
        expected = {
            "dataset": _dataset_id(self.dataset),
            "seed": self.seed,
            "world_size": self.world_size,
            "block_docs": self.block_docs,
            "tokenize_batch": self.tokenize_batch,
        }
        for name, value in expected.items():
            if saved[name] != value:
                raise ValueError(
                    f"data stream state was saved with {name}={saved[name]!r}, "
                    f"this run has {value!r}"
                )
        self._cursor = _Cursor(
            epoch=int(saved["epoch"]),
            block=int(saved["block"]),
            dataset_state=str(saved["dataset_state"]),
            doc=int(saved["doc"]),
            token=int(saved["token"]),
        )
        self.batches = int(saved["batches"])
        self._tokens = None  # rebuilt lazily from the cursor by the next _take

    def restart_after_reshard(self, saved_states: list[dict[str, dict[str, Any]]]) -> None:
        """Continue a run whose checkpoint was written by another number of ranks.

        Saved positions do not map onto the new shards, so every rank starts the epoch after the
        latest saved one (all ranks compute the same epoch): the rest of the interrupted epoch is
        skipped rather than documents being repeated. `saved_states[r]` is what rank r saved.
        """
        entries = [next(iter(state.values())) for state in saved_states]
        if not entries:
            raise ValueError("restart_after_reshard needs at least one saved data state")
        self._cursor = _Cursor(epoch=max(int(e["epoch"]) for e in entries) + 1)
        self.batches = max(int(e["batches"]) for e in entries)
        self._tokens = None

    def _own_entry(self, state: dict[str, dict[str, Any]]) -> dict[str, Any]:
        key = f"rank{self.rank}"
        if key not in state:
            raise ValueError(f"data stream state has no entry for {key} (has {sorted(state)})")
        return state[key]

    # -- token flow --------------------------------------------------------------------------

    def _take(self, count: int) -> np.ndarray:
        """The next `count` tokens of this rank's stream."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            if self._tokens is None:
                self._restore()
            assert self._tokens is not None
            start = self._cursor.token
            available = len(self._tokens) - start
            if available == 0:
                self._next_tokenizer_batch()
                continue
            step = min(available, count - filled)
            out[filled : filled + step] = self._tokens[start : start + step]
            self._cursor.token += step
            filled += step
        return out

    def _restore(self) -> None:
        """(Re)build the reader at the cursor: one block read, one tokenizer batch encoded."""
        cursor = self._cursor
        self._reader.open(cursor.epoch, cursor.dataset_state)
        self._block = self._reader.read_block(cursor.block)
        if not self._block:
            if cursor.block == 0 and not cursor.dataset_state:
                raise DataError(self._reader.empty_message())
            raise ValueError("data stream state points past the end of its epoch")
        self._tokens = self._encode(cursor.doc)

    def _next_tokenizer_batch(self) -> None:
        cursor = self._cursor
        cursor.doc += self.tokenize_batch
        cursor.token = 0
        if cursor.doc < len(self._block):
            self._tokens = self._encode(cursor.doc)
            return
        block_start = self._reader.position()
        block = self._reader.read_block(cursor.block + 1)
        if block:
            self._cursor = _Cursor(cursor.epoch, cursor.block + 1, block_start)
        else:  # the epoch is over: reshuffle and go on
            self._warn_if_tiny()
            self._cursor = _Cursor(cursor.epoch + 1)
            self._reader.open(self._cursor.epoch)
            block = self._reader.read_block(0)
            if not block:
                raise DataError(self._reader.empty_message())
        self._block = block
        self._tokens = self._encode(0)

    def _encode(self, first_doc: int) -> np.ndarray:
        tokens = encode_documents(
            self.tokenizer, self._block[first_doc : first_doc + self.tokenize_batch]
        )
        self._epoch_tokens += len(tokens)
        return tokens

    def _warn_if_tiny(self) -> None:
        """Once: this rank's data is smaller than one micro-batch, so every batch repeats it
        (the loss then says little about the model)."""
        window = self.micro_batch * self.seq_len
        if not self._warned_tiny and 0 < self._epoch_tokens < window:
            self._warned_tiny = True
            logging.getLogger(__name__).warning(
                "--dataset %s: rank %d's training part is %d tokens, less than one micro-batch "
                "(%d x %d tokens), so each batch repeats it ~%d times: add data",
                self.dataset,
                self.rank,
                self._epoch_tokens,
                self.micro_batch,
                self.seq_len,
                window // self._epoch_tokens,
            )
        self._epoch_tokens = 0


class ReadGuard:
    """This rank's micro-batches, surviving a bad read mid-run (a bad byte or record beyond the
    start-up scan, a file that changed).

    The rank must not stop alone: the others are inside the step's collectives with it. So from
    the failed read on it repeats its last batch with weight 0 (no gradient: the step goes on
    with the other ranks' data) and `failure` says what broke and in which file; the training
    loop treats that as a stop request, which every rank acts on at its next logging step
    (checkpoint, then exit with the line)."""

    def __init__(self, stream: TrainStream, text_column: str) -> None:
        self.stream, self.text_column = stream, text_column
        self.failure: str | None = None
        self._last: Batch | None = None

    def next(self) -> tuple[Batch, float]:
        """(batch, loss weight): weight 1 for real data, 0 for the stand-in after a failure."""
        if self.failure is None:
            try:
                self._last = next(self.stream)
                return self._last, 1.0
            except Exception as exc:  # DataError, UnicodeDecodeError, ArrowInvalid, OSError, ...
                self.failure = self._describe(exc)
                logging.getLogger(__name__).error("%s", self.failure)
        if self._last is None:
            ids = torch.zeros(self.stream.micro_batch, self.stream.seq_len, dtype=torch.long)
            self._last = {"input_ids": ids, "labels": ids.clone()}
        return self._last, 0.0

    def _describe(self, exc: BaseException) -> str:
        stream = self.stream
        return read_error_message(exc, stream.dataset, self.text_column, stream.rank, "mid-run")


def read_error_message(
    exc: BaseException, dataset: str, text_column: str, rank: int, when: str
) -> str:
    """One line for a failed read: the DataError's own line, or the local file that fails the
    checks when read in full (a bad byte past the start-up scan), or the error's first line."""
    if isinstance(exc, DataError):
        return str(exc)
    where = f"rank {rank} could not read its data {when} ({first_line(exc)})"
    bad = find_bad_file(dataset, text_column)
    return f"{bad} ({where})" if bad else f"--dataset {dataset}: {where}"


def _dataset_id(dataset: str) -> str:
    """How a saved position names its dataset: a hub name, or a local path's last component
    (a checkpoint stays valid when the data is mounted somewhere else or given relatively)."""
    path = Path(dataset).expanduser()
    return path.resolve().name if path.exists() else dataset


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# --------------------------------------------------------------------------------------------
# Validation and inspection


def validation_batches(
    dataset: str,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    *,
    config_name: str | None = None,
    text_column: str = "text",
    rank: int = 0,
    world_size: int = 1,
) -> list[Batch]:
    """This rank's fixed validation batches: the same every call, disjoint from training.

    Documents come in file order from this rank's shard of the validation split (or of the
    held-out documents), packed like training. Reading stops once enough tokens are collected.
    """
    _require_positive(
        seq_len=seq_len, batch_size=batch_size, num_batches=num_batches, world_size=world_size
    )
    source = _open(dataset, config_name)
    base = source.validation if source.validation is not None else source.train
    view = _rank_view(base, rank, world_size, shard_order=0)
    texts = _texts(iter(view), text_column, source)
    if source.validation is None:
        texts = (t for t in texts if is_held_out(t))
    needed = seq_len * batch_size * num_batches
    chunks, collected = [], 0
    while collected < needed:
        batch = [t for _, t in zip(range(TOKENIZE_BATCH), texts, strict=False)]
        if not batch:
            raise DataError(
                f"--dataset {dataset}: the validation part has only {collected // seq_len} "
                f"windows of {seq_len} tokens for rank {rank} of {world_size}, "
                f"{batch_size * num_batches} needed (data too small, or one document holds "
                "nearly all of it): lower --validation_batches, --val_batch_size or "
                "--max_context_width, or add data"
            )
        chunks.append(encode_documents(tokenizer, batch))
        collected += len(chunks[-1])
    tokens = torch.from_numpy(np.concatenate(chunks)[:needed])
    windows = tokens.view(num_batches, batch_size, seq_len)
    return [{"input_ids": w, "labels": w.clone()} for w in windows]


def epoch_documents(
    dataset: str,
    *,
    config_name: str | None = None,
    text_column: str = "text",
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
    block_docs: int = BLOCK_DOCS,
) -> Iterator[str]:
    """The training documents a TrainStream with these settings packs in `epoch`, in order.

    For tests and debugging ("what does rank 3 read?"); training itself does not use it.
    """
    source = _open(dataset, config_name)
    reader = _BlockReader(source, text_column, rank, world_size, seed, block_docs)
    reader.open(epoch)
    block = 0
    while texts := reader.read_block(block):
        yield from texts
        block += 1
