"""Write train.py's flags as the Markdown table of docs/flags.md (a test keeps it current).

    python -m tools.flags_table           # print the page
    python -m tools.flags_table --write   # rewrite docs/flags.md after adding or changing a flag
    python -m tools.flags_table --check   # exit 1 if docs/flags.md differs from the parser

tests/unit/test_flags_table.py regenerates the page and compares it with docs/flags.md, so the
table cannot go stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from model_utils.config.arguments import build_parser, section_flags
from model_utils.config.flag_spec import Resume, Spec
from model_utils.config.presets import PRESET_FIELDS
from model_utils.config.run_config import flag_specs
from model_utils.errors import OneLineParser

ROOT = Path(__file__).resolve().parent.parent


DOC = ROOT / "docs" / "flags.md"

HEADER = """\
# Flags of train.py

Generated from train.py's parser (`model_utils/config/arguments.py`) by
`.venv/bin/python -m tools.flags_table --write`; do not edit by hand:
`tests/unit/test_flags_table.py` regenerates this page and fails when it differs.
`.venv/bin/python train.py --help` prints the same flags.

Every flag can follow `train.py` or `1.train_llama.sbatch`. Explicit flags override the preset.
Booleans accept `--flag`, `--flag=1`, `--flag=0`. The config field is where the resolved value
lives (`model_utils/config/sections.py`: one typed section per pipeline stage), e.g. `--lr` is
`config.optim.lr`; checkpoint.json and metrics.jsonl record the flat flag names.

Each run writes its resolved flags, one per line, to `<output_dir>/run.args`: `@FILE` on the
command line stands for the flags in FILE, so `.venv/bin/python train.py @runs/tiny-fp8/run.args
--output_dir runs/tiny-fp8-again` (or `RUN_NAME=tiny-fp8-again bash 1.train_llama.sbatch
@runs/tiny-fp8/run.args`: without a new name the launcher's own folder, `runs/local-fp8`, would
resume whatever run it holds) trains the same run again. Everything before the file gives way
to it; flags after it win. Left out of the file: what names one launch rather than the run ("this
launch" below: where it writes, how it starts, what it exports or allows once), except
`--init_from_hf`, the weights it started from.
Any file of flags works the same way: a line is `--flag=value` or `--flag value`, split as a
shell splits it (quote a value with spaces; `#` starts a comment), and a file that names itself
is refused.

"On resume" is what a resume of the run's own checkpoints (`--resume_from_checkpoint`, a
requeue) may do with the flag's value (`model_utils/config/flag_spec.py` declares it, one rule
per flag):
- **kept**: the model's shape, the data stream, the optimizer's stored format, and what the
  loaded optimizer and schedule put back (AdamW's betas and decay, the warm-up and decay style:
  a new value would be recorded but never used). Another value is refused in one line (exit 2)
  naming the way out: a new run in another folder (`RUN_NAME=` with the sbatch, `--output_dir`
  with train.py). A default warm-up that follows a changed `--max_steps` is not a change.
- **same run**: what makes the run the experiment it is (its precision, `--recipe`). Refused
  within the run as *kept* is; a checkpoint of another run given to a new folder may start
  with another value.
- **same run, FP8 on**: as *same run*, while FP8 is on in the checkpoint and in this run.
- **free**: may change, logged as `Flags changed since the checkpoint: ...` (e.g. `--max_steps`
  to train on, except under `--bf16_cooldown`, whose first BF16 step it places; the batch; what
  observes the run). `--lr` and `--min_lr` given on the resuming
  command line replace the saved ones from the resumed step on; not given, the saved ones stay.
- **this launch**: names the launch, not the run; never compared.

"Needs, excludes" is what the flag, when given, declares of the other flags (`needs=` and
`excludes=` in `model_utils/config/sections.py`): a run where a need does not hold, or an
excluded condition does, is refused in one line (exit 2) naming both and the reason.

"""

ON_RESUME = {
    Resume.KEPT: "kept",
    Resume.EXPERIMENT: "same run",
    Resume.FP8_KNOB: "same run, FP8 on",
    Resume.FREE: "free",
    Resume.LAUNCH: "this launch",
}


def pairings(spec: Spec) -> str:
    """``needs --fp8=1; excludes --fp8_weights``: the flag's declared conditions."""
    pairs = (("needs", spec.needs), ("excludes", spec.excludes))
    return "; ".join(f"{kind} {', '.join(c.named for c in when)}" for kind, when in pairs if when)


def rows() -> list[str]:
    section_of = {flag: section for section, flags in section_flags().items() for flag in flags}
    specs = flag_specs()
    out = [
        "| flag | config field | default | on resume | needs, excludes | meaning |",
        "|---|---|---|---|---|---|",
    ]
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
        field = ".".join(filter(None, (section_of[action.dest], action.dest)))
        spec = specs[action.dest]
        out.append(
            f"| `--{action.dest}` | `{field}` | {default} | {ON_RESUME[spec.resume]} | "
            f"{pairings(spec)} | {help_text}{choices} |"
        )
    return out


def page() -> str:
    """The whole of docs/flags.md."""
    return HEADER + "\n".join(rows()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the page")
    mode.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page (default docs/flags.md)")
    args = parser.parse_args(argv)
    text = page()
    if args.write:
        args.doc.write_text(text)
    elif args.check:
        current = args.doc.read_text() if args.doc.is_file() else ""
        if current != text:
            print(f"{args.doc} is stale: run python -m tools.flags_table --write")
            return 1
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
