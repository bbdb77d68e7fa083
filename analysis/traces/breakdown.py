"""Where a step's time goes, per rank, from the ``torch.profiler`` traces ``--profile_steps``
writes: the milliseconds of each category (``rules.CATEGORIES``) of a mean profiled step,
which add up to the step.

A profiled step is a ``ProfilerStep#k`` range holding a ``forward`` range. CPU traces are cut on
the host (``host.py``), GPU traces on the device timeline (``device.py``): kernels,
idle time, and collectives exposed or overlapped with compute. ``analysis/step_breakdown.py``
prints it, and FP8's ceiling from an fp8/bf16 pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median

from analysis.traces.device import device_steps
from analysis.traces.host import DEVICE_CATS, Host, StepTime, host_step, load
from analysis.traces.rules import CATEGORIES
from model_utils.run.profiling import TRACE_METADATA_KEY


def rank_steps(trace: dict) -> list[StepTime]:
    """Every profiled step of one rank's trace (CPU or GPU), in order."""
    events = trace.get("traceEvents", [])
    host = Host(events)
    tid, steps = host.steps()
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not kernels:
        return [host_step(host, tid, ev, k) for k, ev in steps]
    return device_steps(host, tid, steps, kernels, events)


@dataclass
class RankBreakdown:
    """One rank's mean step over the profiled steps, outliers left out (a checkpoint or a
    validation inside the window: a step over 1.5x the median)."""

    rank: int
    steps: list[StepTime]
    left_out: list[int]
    total_ms: float
    ms: dict[str, float]
    overlapped_comm_ms: float
    fp8_gemm_ms: float
    gemm_names: dict[str, float]
    forward_ms: float = 0.0  # compute inside the forward range
    gpu: bool = False  # a trace with device kernels (its steps are the device's timeline)


def summarize(rank: int, steps: list[StepTime]) -> RankBreakdown:
    if not steps:
        raise ValueError(
            f"rank {rank}'s trace holds no profiled step (a ProfilerStep range "
            "with a forward in it)"
        )
    typical = median(s.total_ms for s in steps)
    kept = [s for s in steps if s.total_ms <= 1.5 * typical]
    names = {name for s in kept for name in s.gemm_names}
    return RankBreakdown(
        rank,
        kept,
        [s.step for s in steps if s not in kept],
        fmean(s.total_ms for s in kept),
        {c: fmean(s.ms.get(c, 0.0) for s in kept) for c in CATEGORIES},
        fmean(s.overlapped_comm_ms for s in kept),
        fmean(s.fp8_gemm_ms for s in kept),
        {name: fmean(s.gemm_names.get(name, 0.0) for s in kept) for name in names},
        fmean(s.forward_ms for s in kept),
    )


def read_rank(path: Path, rank: int) -> RankBreakdown:
    trace = load(path)
    # The training step of ProfilerStep#0: run/profiling.py's metadata, 0 if absent.
    offset = int((trace.get(TRACE_METADATA_KEY) or {}).get("first_step", 0))
    steps = rank_steps(trace)
    for s in steps:
        s.step += offset
    summary = summarize(rank, steps)
    summary.gpu = any(e.get("cat") == "kernel" for e in trace.get("traceEvents", []))
    return summary
