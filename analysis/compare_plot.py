"""compare_runs.py's picture: loss vs step, each run's smoothed loss gap to the first inside the
parity band, throughput vs step, and a bar of each run's median throughput with its
ratio to the first; with ``--breakdown``, each run's profiled step as a stacked bar of where it
goes. A run is compare_runs.Run (its ``records``: metrics.jsonl's train and val records, one per
step)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.parity import BAND, SMOOTHING_STEPS, gaps_of
from analysis.traces.rules import CATEGORIES

FIGSIZE, DPI = (20.0, 4.5), 100  # 2000 x 450 pixels


@dataclass
class Breakdown:
    """Each run's profiled step (its slowest rank): milliseconds per category of
    ``traces.rules.CATEGORIES``; ``note``: the ceiling sentence of an fp8/bf16 pair, if the
    runs hold one."""

    ms: list[dict[str, float]]
    note: str | None = None


def throughput_key(runs: Sequence[Any]) -> str:
    """tokens/s per device where every run logs it (this recipe), else samples/s (upstream)."""
    key = "tokens_per_sec_per_device"
    has = all(any(key in r for r in run.records if r["kind"] == "train") for run in runs)
    return key if has else "samples_per_sec"


# ---------------------------------------------------------------------------- the picture


#: Characters per line of the ceiling sentence under the breakdown panel.
NOTE_WIDTH = 60
#: compare_runs --x: what the loss and throughput panels are drawn against, and its words.
X_AXES = {"step": "step", "tokens": "tokens seen"}
_X_KEYS = {"step": "step", "tokens": "tokens_seen"}


def _series(run: Any, kind: str, key: str, x: str = "step") -> tuple[list[int], list[float]]:
    rows = [r for r in run.records if r["kind"] == kind and key in r]
    xs = [r.get(_X_KEYS[x]) for r in rows]
    return xs, [math.nan if r[key] is None else r[key] for r in rows]


def missing_x(run: Any, x: str) -> bool:
    """Whether a run's train records lack the x axis (tokens: logs and runs from before)."""
    return any(r.get(_X_KEYS[x]) is None for r in run.records if r["kind"] == "train")


def make_figure(
    runs: Sequence[Any],
    labels: Sequence[str],
    summaries: Sequence[Mapping[str, Any]],
    *,
    log_steps: bool = False,
    title: str | None = None,
    breakdown: Breakdown | None = None,
    x: str = "step",
    judged_from: int,
    noise: Any = None,
):
    """Loss vs step, throughput vs step, median throughput bars with ratios to the first run.

    A ``matplotlib.figure.Figure`` without pyplot (no global state, no display needed); tests
    read the plotted data back from it."""
    from matplotlib.figure import Figure

    key = throughput_key(runs)
    unit = "tokens/s per device" if key == "tokens_per_sec_per_device" else "samples/s"
    panels = 4 if breakdown is None else 5
    width, height = FIGSIZE
    fig = Figure(figsize=(width * panels / 4, height), dpi=DPI, layout="constrained")
    loss_ax, gap_ax, speed_ax, bar_ax, *step_ax = fig.subplots(1, panels)
    if breakdown is not None:
        plot_breakdown(step_ax[0], labels, breakdown)
    plot_loss_gap(gap_ax, runs, labels, judged_from, noise)
    if log_steps:
        gap_ax.set_xscale("log")
    xlabel = X_AXES[x] + (" (log scale)" if log_steps else "")
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        color = f"C{i}"
        loss_ax.plot(
            *_series(run, "train", "loss", x), color=color, label=f"{label} train", **_style(i)
        )
        where, val = _series(run, "val", "val_loss", x)
        if where:
            loss_ax.plot(where, val, "o--", color=color, label=f"{label} validation")
        speed_ax.plot(*_series(run, "train", key, x), color=color, label=label)
    _dress(loss_ax, "loss", xlabel, "loss", log_steps)
    _dress(speed_ax, f"{unit} (each logged window)", xlabel, unit, log_steps)
    plot_medians(bar_ax, labels, [s.get(key) for s in summaries], unit)
    fig.suptitle(title or " vs ".join(labels))
    return fig


def plot_medians(bar_ax, labels: Sequence[str], medians: Sequence[float | None], unit: str):
    """A bar per run of its median throughput, its ratio to the first run written on it."""
    heights = [m if m is not None else 0.0 for m in medians]
    bars = bar_ax.bar(range(len(labels)), heights, color=[f"C{i}" for i in range(len(labels))])
    # a label a line a word or two: three runs' "fp8 delayed te fp8-attention" ran into each other
    names = [textwrap.fill(label, 12, break_long_words=False) for label in labels]
    bar_ax.set_xticks(range(len(labels)), names, fontsize="small")
    bar_ax.set_ylabel(f"median {unit}")
    bar_ax.set_title(f"median {unit} after warm-up\nratio to {labels[0]}")
    for bar, median in zip(bars, medians, strict=True):
        base = medians[0]
        text = "n/a" if median is None or not base else f"{median / base:.2f}x"
        bar_ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="large",
            fontweight="bold",
        )
    bar_ax.margins(y=0.15)


def _style(i: int) -> dict:
    """Run i's train-loss line: the first wide and solid underneath, the others thinner and
    dashed on top, so a run that tracks the first (a healthy FP8 run) leaves it visible."""
    if i == 0:
        return {"linewidth": 3.5, "alpha": 0.6, "zorder": 2}
    return {"linewidth": 1.5, "linestyle": ("--", ":", "-.")[(i - 1) % 3], "zorder": 2 + i}


def plot_loss_gap(
    ax, runs: Sequence[Any], labels: Sequence[str], judged_from: int, noise: Any = None
) -> None:
    """Each run's smoothed train-loss gap to the first run, relative, in %, inside the band the
    verdict judges it against (analysis/parity.py: the replicas' seed noise, else ±1%), with the
    step the verdict judges from."""
    if noise is not None and noise.replicas and noise.train:
        steps = sorted(noise.train)
        width = [100 * noise.train[s] for s in steps]
        ax.fill_between(
            steps,
            [-w for w in width],
            width,
            color="0.85",
            label=f"seed noise ({noise.replicas} replica(s))",
        )
    else:
        ax.axhspan(-100 * BAND, 100 * BAND, color="0.85", label=f"±{BAND:.0%} band")
    ax.axhline(0.0, color="C0", linewidth=1)
    ax.axvline(judged_from, color="0.4", linestyle=":", label=f"judged from step {judged_from}")
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        if i:
            gaps = gaps_of(run.records, runs[0].records, judged_from)  # the verdict's windows
            ax.plot(
                gaps.whole,
                [100 * g for g in gaps.train],
                color=f"C{i}",
                label=f"{label} vs {labels[0]}",
            )
    _dress(
        ax,
        f"train loss gap to {labels[0]} (mean of <= {SMOOTHING_STEPS} judged steps)",
        "step",
        "relative gap %",
    )


def _dress(ax, title: str, xlabel: str, ylabel: str, log: bool = False) -> None:
    """A line panel's title, axis labels (x log-scaled with ``log``), grid and legend."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if log:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_breakdown(ax, labels: Sequence[str], breakdown: Breakdown) -> None:
    """One horizontal bar per run, its step split into the categories in one colour each, the
    first run on top; the legend beside the axis, the ceiling sentence under it, wrapped to the
    panel's width."""
    rows = range(len(labels))
    left = [0.0] * len(labels)
    for i, (key, words) in enumerate(CATEGORIES.items()):
        widths = [ms.get(key, 0.0) for ms in breakdown.ms]
        if any(widths):
            ax.barh(rows, widths, left=left, color=f"C{i % 10}", label=words)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(list(rows), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_title("where a profiled step goes (slowest rank)")
    note = f"\n{textwrap.fill(breakdown.note, NOTE_WIDTH)}" if breakdown.note else ""
    ax.set_xlabel(f"ms per step{note}", fontsize="small")
    # Beside the bars, not on them (the figure's constrained layout makes room for it).
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
