"""Why a checkpoint cannot be used or written, as exceptions with one-line messages."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from model_utils.errors import first_line
from model_utils.precision.te_requirements import TE_REFUSES_PICKLED_EXTRA_STATE, version_tuple


class ResumeRefused(ValueError):
    """The checkpoint belongs to another run, is damaged, or would be overwritten: one line."""


class CheckpointWriteError(RuntimeError):
    """A save failed (disk full, read-only, permissions, ...): one line saying why and what was
    kept. The temporary directory is removed; published checkpoints are never touched."""


_WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "a file would exceed the size limit (ulimit -f)",
}
_NEARLY_FULL_BYTES = 16 * 2**20


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank exceptions inside DCP's
    CheckpointException (which wraps each as (exception, traceback))."""
    todo, seen = [exc], set()
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__]
        if isinstance(err, CheckpointException):
            todo += [pair[0] for pair in err.failures.values()]


def write_error_reason(exc: BaseException, directory: Path) -> str:
    """Why a save failed, in words: the errno of an OSError anywhere in the chain, else a full
    disk if the directory has next to no free space (torch's zip writer reports ENOSPC as
    "unexpected pos ..."), else the first line of the error."""
    chain = list(_exception_chain(exc))
    for err in chain:
        if isinstance(err, OSError) and err.errno is not None:
            words = _WRITE_ERRNOS.get(err.errno, os.strerror(err.errno))
            return f"{words} ({err.filename or directory})"
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if free is not None and free < _NEARLY_FULL_BYTES:
        return f"no space left on the device ({free / 2**20:.1f} MiB free in {directory})"
    return first_line(chain[-1] if chain else exc)


class UntrustedCheckpointError(RuntimeError):
    """The installed Transformer Engine refuses to unpickle FP8 state in an old checkpoint."""


#: TE's opt-in for unpickling ``_extra_state`` (TE >= 2.18). Never set by this recipe.
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def untrusted_checkpoint_message(path: str | Path, te_version: str) -> str:
    """One line for a format-1 checkpoint whose pickled FP8 state this TE refuses to load."""
    return (
        f"checkpoint {path} stores Transformer Engine's delayed-scaling FP8 state as a Python "
        f"pickle (checkpoint format 1), which Transformer Engine {te_version} refuses to load "
        "because unpickling can run code; if you trust this checkpoint (e.g. your own run "
        f"wrote it), resume once with {TE_UNSAFE_PICKLE_ENV}=1 in the job's environment (the "
        "next checkpoint is saved without pickles), or start a fresh run"
    )


def pickled_fp8_state_problem(
    path: Any, marker: dict[str, Any], te_version: str | None, env: Any
) -> str | None:
    """Why resuming checkpoint ``path`` (its ``checkpoint.json`` is ``marker``) would be refused
    by this TE, or None. Format-1 checkpoints of TE delayed-scaling runs hold TE's pickled FP8
    state; TE >= 2.18 loads it only when the user opts in (we never set the variable)."""
    config = marker.get("run_config") or {}
    pickled = (
        int(marker.get("format", 1)) < 2
        and config.get("model_impl") in ("te", "te_linear")
        and bool(config.get("fp8"))
        and config.get("fp8_recipe") == "delayed"
    )
    release = version_tuple(te_version)
    if not pickled or release is None or release < TE_REFUSES_PICKLED_EXTRA_STATE:
        return None
    if env.get(TE_UNSAFE_PICKLE_ENV, "0") == "1":
        return None
    return untrusted_checkpoint_message(path, te_version)


def all_damaged_message(checkpoint_dir: str | Path, newest_problem: str | None) -> str:
    return (
        f"every checkpoint in {checkpoint_dir} is damaged (newest: {newest_problem}): restore "
        "one from a copy, or pass --overwrite_output_dir without --resume_from_checkpoint to "
        "start afresh"
    )
