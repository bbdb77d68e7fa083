"""The shared words of a refusal: the error a user can fix (UsageError: one line, exit 2), how
any exception becomes a clause of that line, and the line for a location the system refused to
write. A leaf: every stage may raise them without importing the flag parser."""

from __future__ import annotations

import os
from pathlib import Path


class UsageError(ValueError):
    """Bad user input: printed as one line, exit code 2."""


def first_line(exc: BaseException) -> str:
    """An exception as a clause for a one-line message: its type and its first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def os_error_words(exc: OSError) -> str:
    """What the system said, for a one-line message: "No space left on device"."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def unwritable(flag: str, path: Path, exc: OSError) -> str:
    """The one line for a location the system refused when the run tried it."""
    words = os_error_words(exc)
    return f"{flag} {path} cannot be written ({words}): choose another {flag}"
