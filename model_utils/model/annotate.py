"""Names for the seams of a training step, as ``torch.profiler`` ranges.

A profiler trace of a step is a flat soup of operators and kernels; these ranges say which part
of the recipe launched each one: waiting for data, the forward, ``lm_head`` and its loss (the
GEMMs FP8 never runs), the backward, the optimizer. ``analysis/step_breakdown.py`` reads them
(with the kernel and operator rules of ``analysis/traces/rules.py``) to split the step into
what FP8 speeds up and what it cannot.

Outside a profiler's window :func:`annotate` is a ``nullcontext``: a RecordFunction costs a few
microseconds per range even when nothing records it, and the step pays for nothing it does not
use (``benchmarks/bench_profiler_cost.py`` measures it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

DATA_WAIT = "data_wait"
FORWARD = "forward"
BACKWARD = "backward"
#: lm_head and the loss through it (chunked or HF's): bf16 in every FP8 recipe.
LM_HEAD = "lm_head"
#: gradient clip, optimizer, LR schedule, the backend's bookkeeping (torchao's scale precompute).
OPTIMIZER = "optimizer"
#: validation and checkpoint saves: the run's step meter leaves them out of the step time
#: (report/metrics/meter.py), and so does the breakdown.
OUTSIDE_STEP = "outside_step"


def annotate(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a profiler records, else a no-op context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()
