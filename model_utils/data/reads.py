"""A rank's reads going wrong, with every rank stopping together: a data problem may show on
one rank only (each reads its own shard), yet all ranks are inside the same collectives.
At start-up (`build.build_data`) every rank learns the first problem and raises it; mid-run
(`ReadGuard`) the failed rank finishes the step's micro-batches with weight-0 stand-ins, the
ranks agree before the optimizer step that this step read bad data (`ReadGuard.all_read`), the
step is not taken or recorded, and `raise_read_failure` turns the line into the run's exit
message after the save of the last full step. A read the system refused inside the Hugging Face
cache (`cache_location`, which train.py also checks before the start) names the cache, not the
data.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from model_utils.data.checks import find_bad_file
from model_utils.data.sources import DataError
from model_utils.data.stream import Batch
from model_utils.errors import first_line, unwritable

if TYPE_CHECKING:
    from model_utils.parallel.distributed import World


class ReadGuard:
    """This rank's micro-batches, surviving a bad read mid-run (a bad byte or record beyond the
    start-up scan, a file that changed).

    The rank must not stop alone: the others are inside the step's collectives with it. So from
    the failed read on it repeats its last batch with weight 0 to the end of the step, and
    `failure` says what broke and in which file; `all_read` then tells every rank, and the loop
    drops the step, saves the last full one (with the stream where that step's reads began:
    :meth:`rewind`) and exits with the line."""

    def __init__(self, stream: Any, text_column: str, world_size: int = 1) -> None:
        # stream: the run's build.RankStream (build.py imports this module)
        self.stream, self.text_column = stream, text_column
        self.failure: str | None = None
        self._last: Batch | None = None
        self._step_start: dict | None = None  # the stream's position before this step's reads
        # One host-side flag a step, on its own gloo group: no wait for the device (an NCCL
        # all-reduce read on the host would drain the queue every step). One rank: none.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None

    def all_read(self) -> bool:
        """Whether every rank read real data for every micro-batch so far (all ranks call it
        once a step, before the optimizer step)."""
        failed = torch.tensor([int(self.failure is not None)])
        if self._group is not None:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._group)
        if not failed.item():
            self._step_start = None  # the next read begins the next step
        return not bool(failed.item())

    def rewind(self) -> None:
        """The stream back where the dropped step's reads began: a saved position past them
        would skip, on resume, the micro-batches a rank read before some rank's read failed."""
        if self._step_start is not None:
            self.stream.load_state_dict(self._step_start)

    def next(self) -> tuple[Batch, float]:
        """(batch, loss weight): weight 1 for real data, 0 for the stand-in after a failure."""
        if self._step_start is None:
            self._step_start = self.stream.state_dict()
        if self.failure is None:
            try:
                self._last = next(self.stream)
                return self._last, 1.0
            except Exception as exc:  # DataError, UnicodeDecodeError, ArrowInvalid, OSError, ...
                self.failure = read_error_message(
                    exc, self.stream.dataset, self.text_column, self.stream.rank, "mid-run"
                )
                logging.getLogger(__name__).error("%s", self.failure)
        if self._last is None:
            ids = torch.zeros(self.stream.micro_batch, self.stream.seq_len, dtype=torch.long)
            self._last = {"input_ids": ids, "labels": ids.clone()}
        return self._last, 0.0


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


def cache_location(env: dict[str, str] | None = None) -> dict[str, Path]:
    """The Hugging Face cache the data and tokenizer libraries create and write even for
    local files, named by the variable that placed it: an unwritable HF_HOME failed at the
    first read, reported as a --dataset problem."""
    env = os.environ if env is None else env
    for var in ("HF_DATASETS_CACHE", "HF_HOME"):
        if env.get(var):
            return {var: Path(env[var]).expanduser()}
    base = env.get("XDG_CACHE_HOME") or "~/.cache"
    return {"HF_HOME (unset: the default)": Path(base).expanduser() / "huggingface"}


def _cache_problem(exc: BaseException) -> str | None:
    """The line for a Hugging Face cache the system refused (HF_HOME on a read-only or virtual
    file system: what the start-up access() check cannot see), naming the variable, not the data."""
    filename = getattr(exc, "filename", None)
    if not isinstance(exc, OSError) or not filename:
        return None
    ((var, cache),) = cache_location().items()
    inside = Path(filename).expanduser().absolute().is_relative_to(cache.absolute())
    return unwritable(var, cache, exc) if inside else None


def raise_read_failure(failure: str | None, world: World, step: int, path: Path | None) -> None:
    """After the bad read: if any rank met bad data mid-run, DataError (every rank, with that
    rank's line) saying which step was dropped and what is kept; the caller exits 2."""
    from model_utils.parallel.distributed import first_problem

    first = first_problem(failure)
    if not first:
        return
    kept = (
        f"checkpoint of step {step} at {path}; fix or remove the file, then resume with "
        "--resume_from_checkpoint auto (and --allow_data_change, the file having changed)"
        if path is not None
        else "nothing was trained, no checkpoint saved; fix or remove the file, then run again"
    )
    raise DataError(f"{first}; step {step + 1} met it and was not taken: {kept}")
