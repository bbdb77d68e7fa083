"""Every command refuses a bad argument in one line, ``PROG: error: ...``, exit 2, and takes no
abbreviated flag: argparse's own parser printed its usage block above the line (four commands
did), and its prefix matching took ``--output /x`` for ``--output_dir``."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from model_utils.errors import OneLineParser, UsageError, said

ROOT = Path(__file__).resolve().parents[2]
#: Where the commands live; the launcher checks its flags with train.py's own parser.
COMMAND_DIRS = ("scripts", "tools", "analysis", "benchmarks")
#: These hand flags they do not know to train.py (which refuses them in one line).
BAD_ARGS = {"scripts.demo": ["--compute", "tpu"], "benchmarks.bench_gpu_matrix": ["--modes", "x"]}


def commands() -> list[str]:
    """The modules with a ``main`` that parses its arguments (its own parser or benchmarks')."""
    found = []
    for folder in COMMAND_DIRS:
        for path in sorted((ROOT / folder).glob("*.py")):
            text = path.read_text()
            if "def main(" in text and re.search(r"OneLineParser\(|\boptions\(__doc__", text):
                found.append(f"{folder}.{path.stem}")
    return found


def test_a_bad_argument_is_one_line_and_exit_2(capsys) -> None:
    parser = OneLineParser(prog="cmd.py")
    parser.add_argument("--steps", type=int)
    for argv, says in [
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--step", "3"], "unrecognized arguments: --step 3"),  # no prefix matching
    ]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines() == [f"cmd.py: error: {says}"]


def test_a_caller_with_its_own_handler_gets_the_line_raised(capsys) -> None:
    parser = OneLineParser(raises=UsageError)
    with pytest.raises(UsageError, match="unrecognized arguments: --x"):
        parser.parse_args(["--x"])
    assert capsys.readouterr().err == ""


def test_every_command_builds_its_parser_on_the_one_line_parser() -> None:
    """A new command on argparse's own parser would print the usage block again."""
    plain = [
        str(path.relative_to(ROOT))
        for folder in (*COMMAND_DIRS, "model_utils")
        for path in (ROOT / folder).rglob("*.py")
        if "argparse.ArgumentParser(" in path.read_text()
    ]
    assert plain == []
    assert {"scripts.convert_checkpoint", "analysis.step_breakdown"} <= set(commands())


@pytest.mark.parametrize("module", commands())
def test_every_command_refuses_an_unknown_flag_in_one_line(module, capsys, monkeypatch) -> None:
    command = importlib.import_module(module)
    argv = BAD_ARGS.get(module, ["--no_such_flag"])
    monkeypatch.setattr(sys, "argv", [f"{module.rsplit('.')[-1]}.py", *argv])
    with pytest.raises(SystemExit) as exited:
        sys.exit(command.main())
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2, err
    assert len(err) == 1 and err[0].startswith(f"{module.rsplit('.')[-1]}.py: error: "), err


def test_a_refusal_whose_message_holds_lines_is_still_one_line(capsys) -> None:
    """--init_from_hf with `"hidden_size": "256"` printed transformers' two-line message."""
    problem = "cannot read config.json: Validation error for field 'hidden_size':\n  TypeError: x"
    assert said("train.py", problem) == 2
    assert capsys.readouterr().err == (
        "train.py: error: cannot read config.json: Validation error for field 'hidden_size': "
        "TypeError: x\n"
    )
