"""This rank's data for a run, built from the data section: its shards of the training stream
and their fixed validation batches, with a problem on any rank raised on every rank (each reads
its own shards, so a problem may show on one rank only while all wait in the same collectives).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from model_utils.data.reads import read_error_message
from model_utils.data.sources import DataError
from model_utils.data.stream import Batch, TrainStream
from model_utils.data.validation import validation_batches
from model_utils.errors import refuse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from model_utils.config.run_config import Config
    from model_utils.config.sections import DataConfig
    from model_utils.parallel.distributed import World


class RankStream:
    """This rank's training micro-batches, from its shards of the data, the one behind first.

    A run's data is cut into as many shards as its launch had ranks, each a `TrainStream` whose
    position every checkpoint keeps. A resume on a number of ranks that divides that count gives
    each rank every world_size-th shard, continued where it stopped: nothing skipped and nothing
    read twice (a two-rank run resumed on one rank with twice the accumulation trains on the
    very same batches a step), and validates on those shards' validation batches. On any other
    number the data is cut anew and starts the next epoch (`restart_after_reshard`).
    """

    def __init__(
        self,
        source: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        validations: int = 1,
        **shard_options: Any,
    ) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size
        self._shard = partial(TrainStream, source, tokenizer, seq_len, **shard_options)
        self._validation = partial(validation_batches, source, tokenizer, seq_len, validations)
        self._cut(world_size, "at start-up")
        self.dataset, self.micro_batch, self.seq_len = (
            source.dataset,
            source.train_batch_size,
            seq_len,
        )

    def _cut(self, count: int, when: str) -> None:
        """Read `count` shards, this rank every world_size-th from its rank on, and validate on
        theirs (all ranks call it: a shard's problem stops them all with its one line)."""
        from model_utils.parallel.distributed import first_problem

        mine, problem = range(self.rank, count, self.world_size), None
        try:
            self.shards = [self._shard(rank=shard, world_size=count) for shard in mine]
            self.val_batches = [b for s in mine for b in self._validation(rank=s, world_size=count)]
        except (ValueError, OSError) as exc:  # DataError, a bad byte (UnicodeDecodeError), ...
            source = self.source
            problem = read_error_message(exc, source.dataset, source.text_column, self.rank, when)
        refuse(first_problem(problem), DataError)

    def __next__(self) -> Batch:
        return next(min(self.shards, key=lambda shard: shard.batches))  # the first on a tie

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each shard's position under its own key (`TrainStream.state_dict`)."""
        return {key: entry for shard in self.shards for key, entry in shard.state_dict().items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Continue this rank's shards of a saved position (`state` may hold other ranks' too);
        a ValueError if this world size cannot read its shards or they do not fit."""
        count = max(int(entry["world_size"]) for entry in state.values())
        if count % self.world_size:
            raise ValueError(f"data state has {count} shards: not a multiple of {self.world_size}")
        if count != self.shards[0].world_size:
            self._cut(count, "at the resume")
        for shard in self.shards:
            shard.load_state_dict(state)  # a shard of another count or seed: a ValueError

    def restart_after_reshard(self, saved_states: list[dict[str, dict[str, Any]]]) -> str:
        """Continue a run whose checkpoint was written by another number of ranks (`saved_states`
        [r]: what rank r saved); what it did, in words for the log."""
        state = {key: entry for saved in saved_states for key, entry in saved.items()}
        count = max(int(entry["world_size"]) for entry in state.values())
        if count % self.world_size == 0:
            self.load_state_dict(state)
            each = count // self.world_size
            return (
                f"data stream continues each of its {count} shards where it stopped ({each} a rank)"
            )
        epoch, batches = (
            max(int(e[name]) for e in state.values()) for name in ("epoch", "batches")
        )
        for shard in self.shards:  # cut for this launch's ranks at start-up
            shard.restart_at_epoch(epoch + 1, batches)
        return (
            f"data stream starts epoch {epoch + 1}, cut anew for {self.world_size} rank(s): the "
            f"rest of epoch {epoch} is not read, and what it read comes again (a resume on a "
            f"divisor of {count} ranks would have continued it exactly)"
        )


def build_data(config: Config, tokenizer: PreTrainedTokenizerBase, world: World) -> RankStream:
    """This rank's shards of the training stream, their validation batches read (`val_batches`)."""
    seed = config.run.seed if config.run.data_seed is None else config.run.data_seed
    return RankStream(
        config.data,
        tokenizer,
        config.model.max_context_width,
        rank=world.rank,
        world_size=world.world_size,
        validations=config.run.validation_batches,
        seed=seed,
    )
