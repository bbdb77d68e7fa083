"""This rank's endless stream of packed training windows and its resumable position (how the
order is shuffled and what a position holds: the package docstring, Order and Position)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model_utils.data.sources import (
    DataError,
    document_texts,
    epoch_shard_order,
    is_held_out,
    open_source,
    rank_view,
    require_positive,
)
from model_utils.data.tokens import TOKENIZE_BATCH, encode_documents

if TYPE_CHECKING:  # imported lazily at run time: transformers/datasets are slow to import
    from datasets import IterableDataset
    from transformers import PreTrainedTokenizerBase

    from model_utils.config.sections import DataConfig

BLOCK_DOCS = 1024  # documents read and permuted together (the shuffle window)

Batch = dict[str, torch.Tensor]


class _BlockReader:
    """This rank's training documents of one epoch, read block by block in shuffled order."""

    def __init__(
        self, source: DataConfig, rank: int, world_size: int, seed: int, block_docs: int
    ) -> None:
        self.text_column = text_column = source.text_column
        self.source = open_source(source.dataset, source.dataset_config_name, text_column)
        self.rank, self.world_size, self.seed, self.block_docs = rank, world_size, seed, block_docs
        # Held-out documents are filtered out only when validation comes from the training part.
        self.skip_held_out = self.source.validation is None
        self.epoch = 0
        self._view: IterableDataset | None = None
        self._documents: Iterator[str] = iter(())

    def open(self, epoch: int, dataset_state: str = "") -> None:
        """Start reading `epoch`, at the start or at a block start saved by `position()`."""
        self.epoch = epoch
        self._view = rank_view(
            self.source.train, self.rank, self.world_size, epoch_shard_order(self.seed, epoch)
        )
        if dataset_state:
            self._view.load_state_dict(json.loads(dataset_state))
        texts = document_texts(iter(self._view), self.text_column, self.source)
        self._documents = (t for t in texts if not (self.skip_held_out and is_held_out(t)))

    def position(self) -> str:
        """The datasets state after the documents read so far (JSON, "" before any read)."""
        state = self._view.state_dict() if self._view is not None else None
        return json.dumps(state) if state else ""

    def read_block(self, block: int) -> list[str]:
        """The next `block_docs` documents (fewer at the end), permuted by (seed, epoch, block)."""
        texts = list(islice(self._documents, self.block_docs))
        order = np.random.default_rng([self.seed, self.epoch, block]).permutation(len(texts))
        return [texts[i] for i in order]

    def empty_message(self) -> str:
        return (
            f"--dataset {self.source.name}: shard {self.rank} of {self.world_size} (a rank's part) "
            "has no training documents (dataset too small, or all are empty or held out)"
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
    """Endless iterator over one shard's training micro-batches (the part rank ``rank`` of
    ``world_size`` ranks reads; `build.RankStream` gives a rank its shards): {input_ids,
    labels}, each a LongTensor [micro_batch, seq_len], read as the run's data section says
    (``source``: the dataset, its config name and text column; ``train_batch_size`` is the
    micro-batch).

    labels == input_ids: Hugging Face causal LMs shift them internally. When the training part is
    exhausted a new epoch starts, reshuffled deterministically from (seed, epoch).

    `state_dict()` returns {f"rank{rank}": {...}}: fixed keys holding ints and strings, under a
    key that names the rank, so that torch.distributed.checkpoint saves every rank's position
    (DCP keeps one copy of identical keys across ranks) and a fresh stream's state_dict() is a
    valid load template. The object follows DCP's Stateful protocol and can be put in the
    checkpoint's state dict as is.
    """

    def __init__(
        self,
        source: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        block_docs: int = BLOCK_DOCS,
        tokenize_batch: int = TOKENIZE_BATCH,
        prefetch: bool = True,
    ) -> None:
        micro_batch = source.train_batch_size
        require_positive(seq_len=seq_len, micro_batch=micro_batch, world_size=world_size)
        require_positive(block_docs=block_docs, tokenize_batch=tokenize_batch)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset, self.text_column = source.dataset, source.text_column
        self.tokenizer, self.seq_len, self.micro_batch = tokenizer, seq_len, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.block_docs, self.tokenize_batch = block_docs, tokenize_batch
        self._reader = _BlockReader(source, rank, world_size, seed, block_docs)
        self._cursor = _Cursor()
        self._block: list[str] = []  # texts of the current block, shuffled
        self._tokens: np.ndarray | None = None  # tokens of the current tokenizer batch
        # (block, first document, tokens to come) of the block's next tokenizer batch
        self._prefetch = ThreadPoolExecutor(1, "tokenize") if prefetch else None
        self._ahead: tuple[list[str], int, Future[np.ndarray]] | None = None
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

    def _identity(self) -> dict[str, Any]:
        """What a saved position is valid for: the same dataset, seed, world size, blocks."""
        return {
            "dataset": _dataset_id(self.dataset),
            "seed": self.seed,
            "world_size": self.world_size,
            "block_docs": self.block_docs,
            "tokenize_batch": self.tokenize_batch,
        }

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's position: small, plain, and the same keys before and after iterating."""
        state = {**self._identity(), "batches": self.batches, **asdict(self._cursor)}
        return {f"rank{self.rank}": state}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Resume at a saved position; the next batch is the one the saved run would have yielded.

        Only a state saved by the same rank of a run with the same world size, dataset, seed and
        block sizes fits; anything else is a ValueError (see `build.RankStream`).
        """
        saved = state.get(key := f"rank{self.rank}")
        if saved is None:
            raise ValueError(f"data stream state has no entry for {key} (has {sorted(state)})")
        for name, value in self._identity().items():
            if saved[name] != value:
                raise ValueError(
                    f"data stream state was saved with {name}={saved[name]!r}, "
                    f"this run has {value!r}"
                )
        # Each field read back as its default's type: ints, and the dataset state's JSON string.
        self._cursor = _Cursor(**{k: type(v)(saved[k]) for k, v in asdict(_Cursor()).items()})
        self.batches = int(saved["batches"])
        self._tokens = None  # rebuilt lazily from the cursor by the next _take

    def restart_at_epoch(self, epoch: int, batches: int) -> None:
        """Start `epoch` from its beginning, counting `batches` micro-batches yielded so far."""
        self._cursor, self.batches, self._tokens = _Cursor(epoch=epoch), batches, None

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
        """The block's tokenizer batch at `first_doc`; the next one is encoded on a thread while
        the steps run (the Rust tokenizer lets go of the GIL), so a step waits for it only at a
        block's start, where the reader's position moves (on this thread alone)."""
        ahead, self._ahead, size = self._ahead, None, self.tokenize_batch
        if ahead is not None and ahead[0] is self._block and ahead[1] == first_doc:
            tokens = ahead[2].result()
        else:
            if ahead is not None:
                ahead[2].exception()  # a stale one (a resume moved the cursor): let it finish
            tokens = encode_documents(self.tokenizer, self._block[first_doc : first_doc + size])
        following = first_doc + size
        if self._prefetch is not None and following < len(self._block):
            texts = self._block[following : following + size]
            job = self._prefetch.submit(encode_documents, self.tokenizer, texts)
            self._ahead = (self._block, following, job)
        self._epoch_tokens += len(tokens)
        return tokens

    def _warn_if_tiny(self) -> None:
        """Once: this rank's data is smaller than one micro-batch, so every batch repeats it
        (the loss then says little about the model)."""
        window = self.micro_batch * self.seq_len
        if not self._warned_tiny and 0 < self._epoch_tokens < window:
            self._warned_tiny = True
            logging.getLogger(__name__).warning(
                "--dataset %s: shard %d of %d (a rank's part) is %d tokens, less than one "
                "micro-batch (%d x %d tokens), so each batch repeats it ~%d times: add data",
                self.dataset,
                self.rank,
                self.world_size,
                self._epoch_tokens,
                self.micro_batch,
                self.seq_len,
                window // self._epoch_tokens,
            )
        self._epoch_tokens = 0


def _dataset_id(dataset: str) -> str:
    """How a saved position names its dataset: a hub name, or a local path's last component
    (a checkpoint stays valid when the data is mounted somewhere else or given relatively)."""
    path = Path(dataset).expanduser()
    return path.resolve().name if path.exists() else dataset
