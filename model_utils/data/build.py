"""This rank's data for a run, built from the data section: the training stream and the fixed
validation batches, with a start-up problem on any rank raised on every rank (each reads its
own shard, so a problem may show on one rank only while all wait in the same collectives)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from model_utils.data.reads import read_error_message
from model_utils.data.sources import DataError
from model_utils.data.stream import RankStream, TrainStream
from model_utils.data.validation import validation_batches
from model_utils.errors import refuse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from model_utils.config.run_config import Config
    from model_utils.parallel.distributed import World


def build_data(config: Config, tokenizer: PreTrainedTokenizerBase, world: World) -> RankStream:
    """This rank's training stream, its validation batches read (`val_batches`). Every rank
    learns a data problem (all_gather) and all raise DataError with its one line."""
    from model_utils.parallel.distributed import first_problem

    source, seq_len = config.data, config.model.max_context_width
    stream = problem = None
    try:
        seed = config.run.seed if config.run.data_seed is None else config.run.data_seed
        stream = RankStream(
            partial(TrainStream, source, tokenizer, seq_len, seed=seed),
            partial(validation_batches, source, tokenizer, seq_len, config.run.validation_batches),
            world.rank,
            world.world_size,
        )
    except (ValueError, OSError) as exc:  # DataError, a bad byte (UnicodeDecodeError), ...
        problem = read_error_message(
            exc, source.dataset, source.text_column, world.rank, "at start-up"
        )
    refuse(first_problem(problem), DataError)
    return stream
