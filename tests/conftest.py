"""Tiers: ``make test`` is the CPU tier; ``pytest -m gpu tests/test_gpu.py`` the GPU tier.

The CPU tier must behave the same on a laptop, in CI and on a GPU node (no test may fail just
because a GPU or Transformer Engine is present), so unless the run selects the ``gpu`` marker,
CUDA devices are hidden from this process and the subprocesses it starts, before torch
initialises CUDA. GPU-tier tests skip themselves without a GPU.
"""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
