"""End-of-run numbers from the JSONL records, and tables that set runs side by side."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from model_utils.report.metrics.records import tflops_text

# (key in summary, label, format) in display order.
_SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("samples_per_sec", "samples/s (median)", "{:.2f}"),
    ("tokens_per_sec_per_device", "tokens/s/device (median)", "{:,.0f}"),
    ("tflops_per_device", "TFLOP/s/device (median)", "tflops"),
    ("mfu", "MFU % vs bf16 peak (median)", "{:.1f}"),
    ("data_wait_pct", "data wait % (median)", "{:.1f}"),
    ("peak_mem_gib", "peak memory GiB (max)", "{:.2f}"),
    ("final_train_loss", "final train loss", "{:.5f}"),
    ("final_val_loss", "final validation loss", "{:.5f}"),
)
_MEDIAN_KEYS = tuple(key for key, label, _ in _SUMMARY_ROWS if label.endswith("(median)"))
_LABEL_WIDTH = max(len(label) for _, label, _ in _SUMMARY_ROWS)

#: Steps left out of throughput medians (allocator growth, lazy init, compilation): train.py's
#: summary and compare_runs use min(this, max_steps // 2).
SPEED_WARMUP_STEPS = 10


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def one_per_step(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Train then val records, one per step (the last one logged), in step order: a requeued
    job logs again the steps it re-runs after its checkpoint, and they must count once; a
    launch's run record drops what earlier launches logged past the step it resumed from (a
    resume from an older checkpoint, or at another --logging_freq, re-logs other steps)."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "run" and record.get("start_step") is not None:
            latest = {key: r for key, r in latest.items() if key[1] <= record["start_step"]}
        elif record.get("kind") in ("train", "val"):
            latest[(record["kind"], record["step"])] = dict(record)
    return [latest[key] for key in sorted(latest, key=lambda k: (k[0] != "train", k[1]))]


def summarize(records: Iterable[Mapping[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """End-of-run numbers: medians over logged train records with ``step > warmup_steps`` and
    not marked ``speed_warmup`` (a window holding a launch's first steps: a resumed run warms up,
    and compiles, again).

    Each step counts once, as last logged (a resumed run re-logs the steps it re-runs).
    Warm-up steps (allocator growth, lazy init, compilation) are excluded from throughput but
    not from the losses: ``final_train_loss`` is the last logged train loss and
    ``final_val_loss`` the last validation record's ``val_loss``. Peak memory is the maximum over
    all records (it is a peak). A metric with no record after warm-up is None.
    """
    ordered = one_per_step(records)
    train = [r for r in ordered if r["kind"] == "train"]
    val = [r for r in ordered if r["kind"] == "val"]
    measured = [r for r in train if r["step"] > warmup_steps and not r.get("speed_warmup")]
    summary: dict[str, Any] = {key: _median(r.get(key) for r in measured) for key in _MEDIAN_KEYS}
    memory = [r["peak_mem_gib"] for r in train if r.get("peak_mem_gib") is not None]
    summary["peak_mem_gib"] = max(memory) if memory else None
    summary["final_train_loss"] = train[-1]["loss"] if train else None
    summary["final_val_loss"] = val[-1]["val_loss"] if val else None
    summary["measured_records"] = len(measured)
    summary["warmup_steps"] = warmup_steps
    summary["last_step"] = train[-1]["step"] if train else None
    return summary


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "n/a"
    return tflops_text(value) if fmt == "tflops" else fmt.format(value)


def _shows_zero(cell: str) -> bool:
    """A cell that prints as 0 (0.0, 0.00000): a ratio beside two of them would be read as a
    measured change, though the table shows none (e.g. data wait 0.04% vs 0.02%)."""
    try:
        return float(cell.replace(",", "")) == 0
    except ValueError:
        return False


def format_summary(summary: Mapping[str, Any], title: str = "Summary") -> str:
    """Multi-line human summary of :func:`summarize`'s result."""
    head = (
        f"{title} (medians over {summary['measured_records']} logged steps after "
        f"step {summary['warmup_steps']}, last step {summary['last_step']})"
    )
    lines = [head]
    for key, label, fmt in _SUMMARY_ROWS:
        lines.append(f"  {label:<{_LABEL_WIDTH}}  {_fmt(summary.get(key), fmt)}")
    return "\n".join(lines)


def format_table(summaries: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """Summaries side by side, each after the first followed by its ratio to the first
    (``name/first``): the question is always "what did this change buy over the baseline"."""
    if len(summaries) != len(names) or not summaries:
        raise ValueError(f"{len(summaries)} summaries for {len(names)} names")
    base, first = summaries[0], names[0]
    cols: list[tuple[str, int]] = []  # (header, width)
    for i, name in enumerate(names):
        cols.append((name, max(12, len(name))))
        if i:
            ratio = f"{name}/{first}"
            cols.append((ratio, max(10, len(ratio))))
    lines = ["  " + f"{'':<{_LABEL_WIDTH}}" + "".join(f"  {h:>{w}}" for h, w in cols)]
    for key, label, fmt in _SUMMARY_ROWS:
        cells = []
        for i, summary in enumerate(summaries):
            cells.append(_fmt(summary.get(key), fmt))
            if i:
                a, b = base.get(key), summary.get(key)
                shown = (_fmt(a, fmt), cells[-1])
                if a is None or b is None or a == 0:
                    cells.append("n/a")
                elif all(_shows_zero(c) for c in shown):
                    cells.append("-")
                else:  # from the unrounded medians, not from the cells
                    cells.append(f"{b / a:.3f}")
        row = "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True))
        lines.append(f"  {label:<{_LABEL_WIDTH}}{row}")
    return "\n".join(lines)
