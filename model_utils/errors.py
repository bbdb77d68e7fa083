"""The shared words of a refusal: the one base every refusal has (Refusal: one line, its exit
code), the error a user can fix (UsageError: exit 2), how any exception becomes a clause of
that line, the line for a location the system refused to write, a file written whole (what
a reader finds is the old file or the new, never half of one) and every command's argument
parser. A leaf: every stage may raise them without importing the flag parser."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn


class Refusal(Exception):
    """A run stopped with one line a user can act on, ``train.py: error: ...``, never a
    traceback; train.py's main has one handler for every refusal (:func:`exit_refused`).

    ``exit_code`` 2: bad input or a state the run will not touch (usage, resume, data, lock,
    write problems); 1: the run itself failed (a checkpoint write, a step out of memory).
    ``every_rank``: each rank that raised it says it (an out-of-memory step may be one rank's
    alone); otherwise rank 0 speaks for all."""

    exit_code: int = 2
    every_rank: bool = False


class UsageError(Refusal, ValueError):
    """Bad user input: printed as one line, exit code 2."""


def exit_refused(exc: Refusal, *, is_main: bool = True) -> NoReturn:
    """The one way a refusal ends a process: its line on stderr (rank 0's, or every rank's),
    then its exit code."""
    if is_main or exc.every_rank:
        said("train.py", exc)
    raise SystemExit(exc.exit_code) from None


def said(prog: str, problem: object, status: int = 2) -> int:
    """A command's refusal, ``PROG: error: ...`` on stderr, on one line whatever a library put
    in its message (transformers' config errors hold two); `status`, for its exit."""
    words = " ".join(line.strip() for line in str(problem).splitlines() if line.strip())
    print(f"{prog}: error: {words}", file=sys.stderr, flush=True)
    return status


class OneLineParser(argparse.ArgumentParser):
    """Every command's argument parser: a bad argument is one line, ``PROG: error: ...``, exit 2.
    argparse's usage block above it buried the line a user acts on (--help still shows it).
    A flag is spelled whole: argparse's prefix matching took ``--output /x`` as --output_dir.
    `raises` hands the line to a caller's own handler instead (train.py's, compare_runs')."""

    def __init__(self, *args, raises: type[UsageError] | None = None, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.raises = raises

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        if self.raises:
            raise self.raises(message)
        raise SystemExit(said(self.prog, message))


def refuse(problem: str | None, error: type[Exception] = UsageError) -> None:
    """A check's one-line problem raised as `error`; None (the check passed) raises nothing."""
    if problem:
        raise error(problem)


def first_words(exc: BaseException) -> str:
    """An exception's first line alone, or its type's name when its message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """An exception as a clause for a one-line message: its type and its first line."""
    words = first_words(exc)
    return f"{type(exc).__name__}: {words[:200]}" if str(exc).strip() else words


def os_error_words(exc: OSError) -> str:
    """What the system said, for a one-line message: "No space left on device"."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def unwritable(flag: str, path: Path, exc: OSError) -> str:
    """The one line for a location the system refused when the run tried it."""
    return f"{flag} {path} cannot be written ({os_error_words(exc)}): choose another {flag}"


def write_whole(path: Path, content: str | bytes) -> None:
    """`content` into a temporary beside `path` (this process's own: ranks writing one file never
    share it), synced, then renamed in: a reader sees the old file or the new, never half, and
    a failed write (a full disk) leaves no temporary behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
