"""Where a profiled step goes, per rank, and for an fp8/bf16 pair FP8's ceiling.

    python train.py ... --fp8=0 --profile_steps 20:23 --output_dir runs/a-bf16
    python train.py ... --fp8=1 --profile_steps 20:23 --output_dir runs/a-fp8
    python -m analysis.step_breakdown runs/a-bf16 runs/a-fp8

Reads each run folder's traces (``<run>/profile/step_<N>/rank_<R>.pt.trace.json.gz``, the newest
window unless ``--window N``) and prints, per rank and for the slowest rank, the milliseconds
and share of a mean profiled step in each category: the matmuls FP8 can run, those it cannot
(``lm_head``), FP8's casts, attention, ``lm_head``'s loss, collectives (exposed; overlapped ones
beside the table), optimizer, data wait, other, and on a GPU the time it idles for the host. The
categories add up to the step.

Given an fp8 run and a bf16 run (told apart by the ``fp8`` flag of each run's metrics.jsonl), it
prints each category's speed-up and Amdahl's ceiling of the whole step: if the matmuls FP8 can
run take a share ``f`` of the bf16 step and run ``Y`` times faster, the step cannot get faster
than ``1 / ((1 - f) + f / Y)`` even if nothing else changed; the ideal ceiling uses ``Y = 2``
(H100's FP8 peak over BF16). The measured ratio falls short of the ceiling by what FP8 added
(its casts) and whatever else moved, which the table shows. Then what-ifs from the same shares:
the ceilings had lm_head's matmuls or attention run in FP8 too, and the step had the GPU never
waited for the host (the levers beyond the linears). Runs of different shapes, batches
or worlds are refused; a pair whose categories FP8 does not touch (lm_head, attention, the
optimizer, ...) moved by more than 25% was measured under different conditions and gets that
line instead of a ceiling; on CPU traces the FP8 figures are torchao's emulation, and it says so.

On GPU traces Holistic Trace Analysis (``pip install -e '.[hta]'``), when installed, adds its
temporal breakdown and communication/computation overlap per rank as a cross-check; nothing
here needs it. Bad input is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import re
import runpy
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "environment_check.py"))

from analysis.traces.breakdown import RankBreakdown, read_rank
from analysis.traces.rules import CATEGORIES
from model_utils.config.argv import precision_name
from model_utils.config.sections import ModelShape, flag_fields
from model_utils.errors import OneLineParser, said
from model_utils.report.metrics.records import first_run_record

NAME = "step_breakdown.py"
#: H100 SXM dense peaks: 1979 TFLOP/s FP8 over 989 BF16.
IDEAL_FP8_SPEEDUP = 2.0
_RANK = re.compile(r"^rank_(\d+)\.pt\.trace\.json(\.gz)?$")
#: What reading a damaged, cut short or foreign trace raises (zlib's error is no OSError).
UNREADABLE = (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError)
#: What a pair must share to be compared: the model's shape, the batch and the world.
#: (--fp8_numerics: its report steps cost the FP8 run 3x a step on CPU, read as "another job")
LIKE_FLAGS = (*flag_fields(ModelShape), "train_batch_size", "grad_accum_steps", "fp8_numerics")
#: The categories FP8 does not change. Where one worth UNTOUCHED_MIN_SHARE of the bf16 step
#: differs between the runs by more than UNTOUCHED_TOLERANCE, the two were measured under
#: different conditions (another job, clocks, load) and a ceiling from them would mislead. On the
#: recorded H100 pair (tests/traces) they agree within 5%.
UNTOUCHED = ("bf16_matmul", "attention", "loss", "optimizer", "data_wait", "other")
UNTOUCHED_TOLERANCE = 1.25
UNTOUCHED_MIN_SHARE = 0.05


class Refused(ValueError):
    """Bad input: one line."""


@dataclass
class Run:
    path: Path
    window: Path
    fp8: bool | None
    label: str
    ranks: list[RankBreakdown]
    flags: dict

    @property
    def slowest(self) -> RankBreakdown:
        return max(self.ranks, key=lambda r: r.total_ms)


def trace_window(run: Path, window: int | None) -> Path:
    """``profile/step_<window>``, or the newest ``profile/step_<N>``."""
    folders = {int(p.name[5:]): p for p in (run / "profile").glob("step_*") if p.name[5:].isdigit()}
    if window is None and folders:
        window = max(folders)
    if window not in folders and folders:
        have = " or ".join(str(w) for w in sorted(folders))
        raise Refused(f"{run}: {run / 'profile'} has no step_{window}: give --window {have}")
    if window not in folders:
        which = f"step_{window}" if window is not None else "window"
        raise Refused(
            f"{run}: no profiler traces ({run / 'profile'} has no {which}): train it with "
            "--profile_steps START:END"
        )
    return folders[window]


def run_flags(run: Path) -> dict:
    """The run record's flags (metrics.jsonl's first record), {} if there is none."""
    flags = (first_run_record(run / "metrics.jsonl") or {}).get("flags")
    return flags if isinstance(flags, dict) else {}


def rank_files(folder: Path) -> dict[int, Path]:
    """A window's trace files by rank."""
    return {int(m[1]): p for p in folder.iterdir() if (m := _RANK.match(p.name)) is not None}


def read_run(run: Path, window: int | None) -> Run:
    if not run.is_dir():
        raise Refused(f"{run} is no run folder (give the --output_dir of a profiled run)")
    folder = trace_window(run, window)
    if not folder.is_dir():
        raise Refused(f"{folder} is no trace folder (a file in its place)")
    files = rank_files(folder)
    if not files:
        raise Refused(f"{folder} holds no rank_<R>.pt.trace.json.gz")
    ranks = []
    for rank, path in sorted(files.items()):
        try:
            ranks.append(read_rank(path, rank))
        except UNREADABLE as exc:
            raise Refused(
                f"{path} cannot be read as a profiler trace: {exc!r}; profile it again or delete it"
            ) from exc
    flags = run_flags(run)
    fp8 = flags.get("fp8")
    label = precision_name(fp8, flags.get("bf16", True)) if fp8 is not None else "?"
    return Run(run, folder, fp8, label, ranks, flags)


def unlike_flags(first: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """`other`'s LIKE_FLAGS that differ from `first`'s, in words; compared only where both runs
    recorded flags."""
    return [
        f"{key} {other.get(key)} vs {first.get(key)}"
        for key in LIKE_FLAGS
        if first and other and first.get(key) != other.get(key)
    ]


def check_alike(runs: Sequence[Run]) -> None:
    """Refused: runs of different models, batches or worlds (their steps are not FP8's to
    compare); flags compared only where both runs recorded them."""
    first = runs[0]
    for other in runs[1:]:
        found = unlike_flags(first.flags, other.flags)
        if len(first.ranks) != len(other.ranks):
            found.append(f"world {len(other.ranks)} vs {len(first.ranks)} ranks")
        if found:
            raise Refused(
                f"{other.path} is not like {runs[0].path}: {', '.join(found)}; a breakdown "
                "compares runs of one model, batch and world (only --fp8 differs)"
            )


def _cell(ms: float, total: float) -> str:
    return f"{ms:9.1f} ms {100 * ms / total:5.1f}%" if total else f"{ms:9.1f} ms"


def format_run(run: Run) -> str:
    """One run's table: a column per rank (up to 8), then the slowest rank."""
    shown = run.ranks if len(run.ranks) <= 8 else []
    columns = [(f"rank {r.rank}", r) for r in shown]
    slow = run.slowest
    if len(run.ranks) > 1 or not shown:
        columns.append((f"slowest: rank {slow.rank}", slow))
    steps = ", ".join(str(s.step) for s in slow.steps)
    lines = [
        f"{run.path} ({run.label}): {run.window.name}, steps {steps}, {len(run.ranks)} rank(s)"
    ]
    lines.append(f"  {'':34s}" + "".join(f"{name:>20s}" for name, _ in columns))
    for key, words in CATEGORIES.items():
        if any(r.ms.get(key, 0.0) for _, r in columns):
            cells = "".join(f"{_cell(r.ms[key], r.total_ms):>20s}" for _, r in columns)
            lines.append(f"  {words:34s}{cells}")
    lines.append(
        f"  {'step':34s}" + "".join(f"{_cell(r.total_ms, r.total_ms):>20s}" for _, r in columns)
    )
    for words, field in (
        ("collectives overlapped (not above)", "overlapped_comm_ms"),
        ("GEMMs run in FP8 (by name)", "fp8_gemm_ms"),
    ):
        cells = "".join(f"{getattr(r, field):9.1f} ms{'':7s}".rjust(20) for _, r in columns)
        lines.append(f"  {words:34s}{cells}")
    for r in run.ranks:
        if r.left_out:
            lines.append(
                f"  rank {r.rank}: step(s) {r.left_out} left out (over 1.5x the median step: a "
                "checkpoint or validation inside the window?)"
            )
    return "\n".join(lines)


def amdahl(share: float, speedup: float) -> float:
    """The whole step's speed-up if only a ``share`` of it ran ``speedup`` times faster."""
    return 1.0 / ((1.0 - share) + share / speedup)


@dataclass
class Ceiling:
    """An fp8/bf16 pair in four numbers: the share of the bf16 step FP8 can run, how much
    faster it ran, the step's Amdahl ceiling from those two, and the measured step ratio."""

    share: float
    speedup: float
    ceiling: float
    measured: float

    def sentence(self) -> str:
        pace = "faster" if self.speedup >= 1 else "as fast (slower)"
        return (
            f"The matmuls FP8 can run were {100 * self.share:.1f}% of the bf16 step and ran "
            f"{self.speedup:.2f}x {pace}; ceiling {self.ceiling:.2f}x; measured "
            f"{self.measured:.2f}x."
        )


def moved_untouched(bf16: Run, fp8: Run) -> list[str]:
    """The categories FP8 does not change that moved between the runs beyond the tolerance,
    each with its bf16/fp8 ratio (slowest rank of each)."""
    a, b = bf16.slowest, fp8.slowest
    moved = []
    for key in UNTOUCHED:
        if key == "attention" and fp8.flags.get("fp8_attention"):
            continue  # FP8 attention is FP8's to change
        x, y = a.ms.get(key, 0.0), b.ms.get(key, 0.0)
        if x < UNTOUCHED_MIN_SHARE * a.total_ms or not y:
            continue
        if max(x / y, y / x) > UNTOUCHED_TOLERANCE:
            moved.append(f"{CATEGORIES[key]} {x / y:.2f}x")
    return moved


def ceiling(bf16: Run, fp8: Run) -> Ceiling | None:
    """The pair's ceiling from the slowest rank of each; None if either run has no matmul FP8
    can run (nothing to scale), or the runs were measured under different conditions."""
    a, b = bf16.slowest, fp8.slowest
    fast, slow = a.ms.get("fp8_matmul", 0.0), b.ms.get("fp8_matmul", 0.0)
    if not (fast and slow and a.total_ms and b.total_ms) or moved_untouched(bf16, fp8):
        return None
    share, speedup = fast / a.total_ms, fast / slow
    return Ceiling(share, speedup, amdahl(share, speedup), a.total_ms / b.total_ms)


def what_ifs(bf16: Run, fp8: Run, found: Ceiling) -> list[tuple[str, float]]:
    """Beside today's ceiling, the step's speed-up had more of it gone FP8's way, each from the
    measured shares (slowest rank of each run): lm_head's matmuls at the FP8 matmuls' measured
    speed-up; attention at that speed-up too (a bound: its softmax would not speed up), or at
    its measured one when the fp8 run had --fp8_attention; all of these; and the measured step
    with the fp8 run's GPU never waiting for the host."""
    a, b = bf16.slowest, fp8.slowest
    total, y = a.total_ms, found.speedup

    def ceiling_with(*keys: str) -> float:
        sped = sum(a.ms.get(k, 0.0) / (speedup(k) or y) for k in ("fp8_matmul", *keys))
        kept = total - sum(a.ms.get(k, 0.0) for k in ("fp8_matmul", *keys))
        return total / (kept + sped)

    def speedup(key: str) -> float | None:
        if key == "attention" and fp8.flags.get("fp8_attention") and b.ms.get(key):
            return a.ms[key] / b.ms[key]
        return None

    attention = "attention in FP8" + (
        " (measured)" if speedup("attention") else f" (at {y:.2f}x: a bound)"
    )
    return [
        ("today's ceiling: the matmuls FP8 runs now", found.ceiling),
        (f"+ lm_head's matmuls in FP8 (at {y:.2f}x)", ceiling_with("bf16_matmul")),
        (f"+ {attention}", ceiling_with("attention")),
        ("+ both", ceiling_with("bf16_matmul", "attention")),
        (
            f"measured, had the fp8 GPU never waited for the host ({b.ms.get('idle', 0.0):.1f} ms)",
            total / (b.total_ms - b.ms.get("idle", 0.0)),
        ),
    ]


def format_pair(bf16: Run, fp8: Run) -> str:
    """Each category's speed-up (slowest rank of each run) and the ceiling sentence."""
    a, b = bf16.slowest, fp8.slowest
    lines = [
        f"fp8 {fp8.path} against {bf16.label} {bf16.path} (slowest rank of each):",
        f"  {'':34s}{bf16.label:>12s}{'fp8':>12s}{'speed-up':>10s}{'fp8 - ' + bf16.label:>14s}",
    ]
    for key, words in CATEGORIES.items():
        x, y = a.ms.get(key, 0.0), b.ms.get(key, 0.0)
        if x or y:
            ratio = f"{x / y:9.2f}x" if x and y else f"{'new' if y else 'gone':>10s}"
            lines.append(f"  {words:34s}{x:9.1f} ms{y:9.1f} ms{ratio}{y - x:+11.1f} ms")
    measured = a.total_ms / b.total_ms
    lines.append(
        f"  {'step':34s}{a.total_ms:9.1f} ms{b.total_ms:9.1f} ms{measured:9.2f}x"
        f"{b.total_ms - a.total_ms:+11.1f} ms"
    )
    found, moved = ceiling(bf16, fp8), moved_untouched(bf16, fp8)
    if moved:
        lines.append(
            f"Not comparable: what FP8 does not touch moved ({', '.join(moved)}), so the two "
            "runs were measured under different conditions (another job, clocks, load): no "
            "ceiling; profile both again on a quiet machine."
        )
    elif found is not None:
        lines.append(found.sentence())
        lines.append(
            f"Had they run {IDEAL_FP8_SPEEDUP:.0f}x faster (H100's FP8 peak over BF16), the "
            f"ceiling would be {amdahl(found.share, IDEAL_FP8_SPEEDUP):.2f}x; the matmuls FP8 "
            f"cannot run were {100 * a.ms['bf16_matmul'] / a.total_ms:.1f}% of the bf16 step."
        )
        lines.append("What if (from the measured shares of the bf16 step):")
        lines += [f"  {words:64s}{value:6.2f}x" for words, value in what_ifs(bf16, fp8, found)]
    else:
        lines.append("No matmul FP8 can run was found in one of the runs: no ceiling.")
    if not any(r.gpu for r in (*bf16.ranks, *fp8.ranks)):
        lines.append(
            "CPU traces: FP8 here is torchao's emulation (casts around the matmuls, no FP8 "
            "tensor cores), so its figures are emulation's, not FP8's on a GPU."
        )
    return "\n".join(lines)


def hta_lines(run: Run) -> list[str]:
    """Holistic Trace Analysis's temporal breakdown and comm/compute overlap of a GPU run's
    window, where HTA is installed (an optional extra: it pulls in Jupyter and plotly)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return [f"{run.path}: HTA not installed (pip install -e '.[hta]'): no cross-check"]
    files = {rank: str(path) for rank, path in rank_files(run.window).items()}
    try:
        analysis = TraceAnalysis(trace_files=files, trace_dir=str(run.window))
        temporal = analysis.get_temporal_breakdown(visualize=False)
        overlap = analysis.get_comm_comp_overlap(visualize=False)
    except Exception as exc:  # a cross-check must not hide our own report
        return [f"{run.path}: HTA could not read the traces ({type(exc).__name__}: {exc})"]
    return [
        f"{run.path}: HTA temporal breakdown (all profiled steps but the last):",
        temporal.to_string(index=False),
        f"{run.path}: HTA communication/computation overlap:",
        overlap.to_string(index=False),
    ]


def fp8_pair(runs: Sequence[Run]) -> tuple[Run, Run] | None:
    """The first bf16 run and the first fp8 run, where the runs hold both."""
    bf16 = next((r for r in runs if r.fp8 is False), None)
    fp8 = next((r for r in runs if r.fp8 is True), None)
    return (bf16, fp8) if bf16 and fp8 else None


def report(runs: list[Run], hta: bool = True) -> str:
    parts = [format_run(run) for run in runs]
    if pair := fp8_pair(runs):
        parts.append(format_pair(*pair))
    if hta:
        parts += ["\n".join(hta_lines(run)) for run in runs if any(r.gpu for r in run.ranks)]
    return "\n\n".join(parts)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        description="Where a profiled step goes (--profile_steps), and FP8's ceiling from an "
        "fp8/bf16 pair.",
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (train.py --output_dir)")
    parser.add_argument("--window", type=int, help="profile/step_N to read (default: newest)")
    parser.add_argument("--no_hta", action="store_true", help="skip HTA's cross-check")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [read_run(path, args.window) for path in args.runs]
        check_alike(runs)
    except Refused as exc:
        return said(NAME, exc)
    print(report(runs, hta=not args.no_hta), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
