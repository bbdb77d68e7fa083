"""Data checks that need a process of their own: a Hub dataset name that cannot be reached
(offline) is one clear error, fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from model_utils import data


def test_unreachable_hub_dataset_is_a_clear_error():
    code = (
        "from model_utils.config.sections import DataConfig\n"
        "from helpers.runs import epoch_documents\n"
        "source = DataConfig('tokenizer', 'allenai/c4', 'en', 'text', 1, 1, 'sampled')\n"
        "try:\n"
        "    next(epoch_documents(source))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    root = Path(data.__file__).parents[2]  # the checkout: model_utils and tests/helpers
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.startswith("--dataset allenai/c4: cannot be opened ("), out.stderr[-2000:]
