"""A rank's reads going wrong, with every rank stopping together: a data problem may show on
one rank only (each reads its own shard), yet all ranks are inside the same collectives.
At start-up (`build_data`) every rank learns the first problem and raises it; mid-run
(`ReadGuard`) the failed rank keeps stepping with weight-0 batches until the loop's next stop
check, and `raise_read_failure` turns its line into the run's exit message after the save.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_utils.arguments import first_line
from model_utils.data.checks import find_bad_file
from model_utils.data.sources import DataError
from model_utils.data.stream import Batch, TrainStream
from model_utils.data.validation import validation_batches

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from model_utils.distributed import World


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
    cache = _cache_problem(exc)
    if cache:
        return cache
    reason = first_line(exc)
    if callable(getattr(exc, "details", None)):  # the datasets library's CastError: which columns
        reason = f"{reason}: {exc.details()}"
    where = f"rank {rank} could not read its data {when} ({reason})"
    bad = find_bad_file(dataset, text_column)
    return f"{bad} ({where})" if bad else f"--dataset {dataset}: {where}"


def _cache_problem(exc: BaseException) -> str | None:
    """The line for a Hugging Face cache the system refused (HF_HOME on a read-only or virtual
    file system: what the start-up access() check cannot see), naming the variable, not the
    data."""
    from model_utils.outputs import cache_location, unwritable

    filename = getattr(exc, "filename", None)
    if not isinstance(exc, OSError) or not filename:
        return None
    ((var, cache),) = cache_location().items()
    inside = Path(filename).expanduser().absolute().is_relative_to(cache.absolute())
    return unwritable(var, cache, exc) if inside else None


def build_data(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, world: World
) -> tuple[TrainStream, list[Batch]]:
    """This rank's training stream and validation batches. Each rank reads its own shard, so a
    data problem may show on one rank only: every rank learns it (all_gather) and all raise
    DataError with its one line."""
    from model_utils.distributed import first_problem

    stream = val_batches = problem = None
    try:
        stream = TrainStream(
            args.dataset,
            tokenizer,
            args.max_context_width,
            args.train_batch_size,
            config_name=args.dataset_config_name,
            text_column=args.text_column,
            rank=world.rank,
            world_size=world.world_size,
            seed=args.seed,
        )
        val_batches = validation_batches(
            args.dataset,
            tokenizer,
            args.max_context_width,
            args.val_batch_size,
            args.validation_batches,
            config_name=args.dataset_config_name,
            text_column=args.text_column,
            rank=world.rank,
            world_size=world.world_size,
        )
    except (ValueError, OSError) as exc:  # DataError, a bad byte (UnicodeDecodeError), ...
        problem = read_error_message(exc, args.dataset, args.text_column, world.rank, "at start-up")
    first = first_problem(problem, world.world_size)
    if first:
        raise DataError(first)
    return stream, val_batches


def raise_read_failure(failure: str | None, world: World, step: int, path: Path | None) -> None:
    """After the stop's checkpoint: if any rank met bad data mid-run, DataError (every rank,
    with that rank's line) saying what was saved; the caller exits 2."""
    from model_utils.distributed import first_problem

    first = first_problem(failure, world.world_size)
    if first:
        raise DataError(
            f"{first}; checkpoint saved at step {step} ({path}; the steps since the bad read "
            "went on without that rank's batches): fix or remove the file, then resume with "
            "--resume_from_checkpoint auto"
        )
