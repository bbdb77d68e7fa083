"""TensorBoard for a run (``--tensorboard``): what metrics.jsonl holds, as scalars, from rank 0.

The JSONL file stays the record of truth (the summary, the demo and scripts/compare_runs.py read
it); this is a view for people who watch runs in TensorBoard, as torchtitan and NeMo users do.
Events go to ``<output_dir>/tensorboard``, so ``tensorboard --logdir runs`` shows every run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# Not scalars worth a chart: the x axis, the wall-clock stamp (TensorBoard's own "relative" axis).
_NOT_SCALARS = frozenset({"kind", "step", "time"})


def scalars(record: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(tag, value)`` for every number of a train or validation record, tagged by its kind
    (``train/loss``, ``val/val_loss``): one chart per metric, nothing picked by hand, so a
    metric added to the JSONL shows up in TensorBoard too. None (e.g. MFU on CPU) is skipped."""
    kind = record.get("kind")
    if kind not in ("train", "val"):
        return []
    return [
        (f"{kind}/{key}", float(value))
        for key, value in record.items()
        if key not in _NOT_SCALARS
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ]


def flags_markdown(run: Mapping[str, Any]) -> str:
    """The run record as a two-column Markdown table (TensorBoard's text tab renders Markdown),
    so a chart can be traced back to the exact flags that produced it."""
    rows = ["| flag | value |", "|---|---|"]
    extra = {"world_size": run.get("world_size"), "samples_per_step": run.get("samples_per_step")}
    for key, value in {**run.get("flags", {}), **extra}.items():
        rows.append(f"| {key} | {str(value).replace('|', '/')} |")
    return "\n".join(rows)


class TensorBoardLog:
    """``torch.utils.tensorboard.SummaryWriter`` on rank 0, a no-op elsewhere or when disabled.

    ``resumed_from``: a resumed run passes its checkpoint's step, and TensorBoard drops the
    events after it that the interrupted run wrote (``purge_step``), so the charts show one line,
    not twice the steps between the last checkpoint and the interruption.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], *, enabled: bool, resumed_from: int = 0
    ) -> None:
        self._writer = None
        if enabled:
            # Imported here: only runs that ask for TensorBoard need it importable.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(log_dir),
                purge_step=resumed_from + 1 if resumed_from else None,
                flush_secs=30,
            )

    def flags(self, run: Mapping[str, Any]) -> None:
        if self._writer is not None:
            self._writer.add_text("flags", flags_markdown(run), global_step=0)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        walltime = record.get("time")
        for tag, value in scalars(record):  # a NaN loss is kept: TensorBoard shows it
            self._writer.add_scalar(tag, value, record["step"], walltime=walltime)
        # At every report, like the JSONL: a preempted or crashed run loses no events.
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
