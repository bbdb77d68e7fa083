"""docs/flags.md is tools/flags_table.py's page for today's parser, so it cannot go stale."""

from __future__ import annotations

from pathlib import Path

from model_utils.config import arguments
from tools import flags_table

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "flags.md"


def test_docs_flags_is_the_generated_page():
    assert DOC.read_text() == flags_table.page(), "run python -m tools.flags_table --write"


def test_docs_flags_documents_every_flag():
    text = DOC.read_text()
    parser = arguments.build_parser()
    missing = [a.dest for a in parser._actions if a.dest != "help" and f"`--{a.dest}`" not in text]
    assert missing == [], "regenerate docs/flags.md with python -m tools.flags_table --write"


def test_check_mode_fails_on_a_stale_page_and_write_mends_it(tmp_path, capsys):
    doc = tmp_path / "flags.md"
    doc.write_text(flags_table.page().replace("`--fp8`", "`--fp9`"))
    assert flags_table.main(["--check", "--doc", str(doc)]) == 1
    assert "is stale" in capsys.readouterr().out
    assert flags_table.main(["--write", "--doc", str(doc)]) == 0
    assert flags_table.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text() == flags_table.page()
