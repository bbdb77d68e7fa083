"""scripts/stage_data.py's names for staged datasets (Hub names and local files)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import stage_data  # noqa: E402


def test_slugs_name_hub_datasets_and_local_files() -> None:
    assert stage_data.slug("allenai/c4", "en") == "allenai--c4-en"
    assert stage_data.slug(str(ROOT / "data" / "kjv.jsonl.gz"), None) == "kjv"
    assert stage_data.slug("NousResearch/Meta-Llama-3-8B", None) == "NousResearch--Meta-Llama-3-8B"
