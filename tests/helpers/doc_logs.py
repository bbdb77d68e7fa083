"""The log lines README.md and docs/ show, held to a real run's log: a sample's `[file.py:N]`
tag must be the one today's code prints for the same kind of line, so no sample keeps a line
number that train.py's edits have moved."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_TAGGED = re.compile(r" ([DIWE]) \[(\w+\.py):(\d+)\] +(.*)$")


def kind(message: str) -> str:
    """What a log line reports: its words up to the first colon, numbers as #
    ("Batch 20 Loss: 8.4, ..." -> "Batch # Loss")."""
    return re.sub(r"\d+", "#", message.split(":", 1)[0].strip())


def tag_mismatches(log: str) -> tuple[int, list[str]]:
    """(doc samples checked, those whose tag differs) over the samples of every kind of line
    this log prints."""
    printed: dict[str, str] = {}
    for line in log.splitlines():
        if m := _TAGGED.search(line):
            printed.setdefault(kind(m[4]), f"{m[1]} [{m[2]}:{m[3]}]")
    checked, wrong = 0, []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            m = _TAGGED.search(line)
            if m and kind(m[4]) in printed:
                checked += 1
                shown = f"{m[1]} [{m[2]}:{m[3]}]"
                if shown != printed[kind(m[4])]:
                    wrong.append(
                        f"{page.name}:{number} shows {shown}, a run prints "
                        f"{printed[kind(m[4])]} for {kind(m[4])!r}"
                    )
    return checked, wrong
