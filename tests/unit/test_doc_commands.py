"""Every command README.md and docs/ give runs as written in a fresh shell of the checkout:
no bare ``python``, ``pip`` or console script (a fresh shell has no venv on PATH, and the
system's ``python`` lacks torch or is missing), each ``.venv/bin/`` program exists after the
README's set-up, each ``python -m`` module and each script path is there."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]

#: Programs a fresh shell finds only in the project's venv (or finds the wrong one of).
VENV_PROGRAMS = {"python", "python3", "pip", "pip3", "torchrun", "pytest", "ruff", "wandb"}
VENV_PROGRAMS |= {"mlflow", "tensorboard", "lm_eval", "lm-eval", "hf", "accelerate"}

#: Spans that name such a program but are not commands for the reader's shell: log lines the
#: run prints, and what runs inside the image or the launcher. Each says where it stands.
NOT_COMMANDS = {
    "mlflow cannot start": "a log line (trackers.md, failures.md)",
    "mlflow failed": "a log line",
    "mlflow did not finish": "a log line",
    "pip show": "the Dockerfile's own check, inside the image (cluster.md)",
}

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_SPAN = re.compile(r"`([^`]+)`")
_SHELL = {"", "bash", "sh", "shell", "console"}


def commands(text: str) -> list[str]:
    """Shell commands of a Markdown page: each line of its shell blocks (comments dropped,
    continuation lines joined) and each inline code span, split at ``&&``, ``||``, ``;``, ``|``."""
    found: list[str] = []
    for lang, body in _FENCE.findall(text):
        if lang in _SHELL:
            joined = re.sub(r"\\\n\s*", " ", body)
            found += [ln.split(" #")[0] for ln in joined.splitlines() if not ln.startswith("#")]
    prose = _FENCE.sub("", text)
    spans = [" ".join(span.split()) for span in _SPAN.findall(prose)]
    found += [span for span in spans if " " in span]  # one word names a program, runs nothing
    found = [re.sub(r"'[^']*'", "'...'", c) for c in found]  # what runs inside `bash -c '...'`
    parts = [p for c in found for p in re.split(r"&&|\|\||;|\|", c)]
    return [p.strip().removeprefix("$ ") for p in parts if p.strip()]


def program(command: str) -> tuple[str, list[str]]:
    """The program a command runs and its arguments (after VAR=value assignments)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    return (words[0], words[1:]) if words else ("", [])


def problem(command: str) -> str | None:
    name, args = program(command)
    if any(command.startswith(text) for text in NOT_COMMANDS):
        return None
    if name in VENV_PROGRAMS:
        return f"bare {name!r}: a fresh shell needs .venv/bin/{name}"
    if not name.startswith(".venv/bin/"):
        return None
    if not (ROOT / name).exists():
        return f"{name} is not there after `make .venv/bin/.installed`"
    if Path(name).name.startswith("python") and args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        if importlib.util.find_spec(module) is None:
            return f"no module {module}"
    elif Path(name).name.startswith("python") and args and args[0].endswith(".py"):
        if not (ROOT / args[0]).is_file():
            return f"no script {args[0]}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_of_the_page_runs_as_written(page: Path) -> None:
    bad = [f"{c!r}: {why}" for c in commands(page.read_text()) if (why := problem(c))]
    assert bad == []


def test_the_extraction_finds_blocks_spans_and_the_programs_behind_variables() -> None:
    text = (
        "Run `python -m\nscripts.compare_runs A B` or:\n\n```bash\n# a comment\n"
        "RUN_NAME=x sbatch 1.train_llama.sbatch && tensorboard --logdir runs  # watch\n"
        ".venv/bin/python -m no_such_module_here\n```\n"
    )
    found = commands(text)
    assert found == [
        "RUN_NAME=x sbatch 1.train_llama.sbatch",
        "tensorboard --logdir runs",
        ".venv/bin/python -m no_such_module_here",
        "python -m scripts.compare_runs A B",
    ]
    assert [problem(c) for c in found] == [
        None,
        "bare 'tensorboard': a fresh shell needs .venv/bin/tensorboard",
        "no module no_such_module_here",
        "bare 'python': a fresh shell needs .venv/bin/python",
    ]
