"""This rank's fixed validation batches: the dataset's own `validation` split when it has one,
otherwise the documents `is_held_out` keeps back from training (the same ones every run,
whatever the seed, rank count or file order)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from model_utils.data.sources import (
    DataError,
    document_texts,
    is_held_out,
    open_source,
    rank_view,
    require_positive,
)
from model_utils.data.stream import Batch
from model_utils.data.tokens import TOKENIZE_BATCH, encode_documents

if TYPE_CHECKING:  # imported lazily at run time: transformers is slow to import
    from transformers import PreTrainedTokenizerBase

    from model_utils.config.sections import DataConfig


def validation_batches(
    source: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    num_batches: int,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> list[Batch]:
    """This rank's fixed validation batches: the same every call, disjoint from training.

    Documents come in file order from this rank's shard of the validation split (or of the
    held-out documents), packed like training, ``source.val_batch_size`` windows a batch.
    Reading stops once enough tokens are collected.
    """
    dataset, text_column, batch_size = source.dataset, source.text_column, source.val_batch_size
    require_positive(
        seq_len=seq_len, batch_size=batch_size, num_batches=num_batches, world_size=world_size
    )
    opened = open_source(dataset, source.dataset_config_name, text_column)
    base = opened.validation if opened.validation is not None else opened.train
    view = rank_view(base, rank, world_size, shard_order=0)
    texts = document_texts(iter(view), text_column, opened)
    if opened.validation is None:
        texts = (t for t in texts if is_held_out(t))
    needed = seq_len * batch_size * num_batches
    chunks, collected = [], 0
    while collected < needed:
        batch = [t for _, t in zip(range(TOKENIZE_BATCH), texts, strict=False)]
        if not batch:
            raise DataError(
                f"--dataset {dataset}: the validation part has only {collected // seq_len} "
                f"windows of {seq_len} tokens in shard {rank} of {world_size} (a rank's part), "
                f"{batch_size * num_batches} needed (data too small, or one document holds "
                "nearly all of it): lower --validation_batches, --val_batch_size or "
                "--max_context_width, or add data"
            )
        chunks.append(encode_documents(tokenizer, batch))
        collected += len(chunks[-1])
    tokens = torch.from_numpy(np.concatenate(chunks)[:needed])
    windows = tokens.view(num_batches, batch_size, seq_len)
    return [{"input_ids": w, "labels": w.clone()} for w in windows]
