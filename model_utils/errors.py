"""The shared words of a refusal: the error a user can fix (UsageError: one line, exit 2) and
how any exception becomes a clause of that line. A leaf: every stage may raise them without
importing the flag parser."""

from __future__ import annotations

import os


class UsageError(ValueError):
    """Bad user input: printed as one line, exit code 2."""


def first_line(exc: BaseException) -> str:
    """An exception as a clause for a one-line message: its type and its first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def os_error_words(exc: OSError) -> str:
    """What the system said, for a one-line message: "No space left on device"."""
    return os.strerror(exc.errno) if exc.errno else str(exc)
