"""Print train.py's flags as the Markdown table in README.md (regenerate after adding a flag)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_utils.arguments import build_parser  # noqa: E402
from model_utils.presets import PRESET_FIELDS  # noqa: E402


def rows() -> list[str]:
    out = ["| flag | default | meaning |", "|---|---|---|"]
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        bar = "\\|"
        choices = f" ({bar.join(map(str, action.choices))})" if action.choices else ""
        if action.default is None:
            default = "preset" if action.dest in PRESET_FIELDS else "-"
        elif isinstance(action.default, bool):
            default = str(int(action.default))
        else:
            default = str(action.default)
        if "data/" in default:
            default = default[default.index("data/") :]
        help_text = (action.help or "").replace("|", "\\|")
        out.append(f"| `--{action.dest}` | {default} | {help_text}{choices} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
