"""TensorBoard for a run (``--tensorboard``): what metrics.jsonl holds, as scalars, from rank 0.

The JSONL file stays the record of truth (the summary, the demo and scripts/compare_runs.py read
it); this is a view for people who watch runs in TensorBoard, as torchtitan and NeMo users do.
Events go to ``<output_dir>/tensorboard``, so ``tensorboard --logdir runs`` shows every run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from model_utils.errors import os_error_words

log = logging.getLogger("train")

# Not scalars worth a chart: the x axis, the wall-clock stamp (TensorBoard's own "relative" axis).
_NOT_SCALARS = frozenset({"kind", "step", "time"})


def scalars(record: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(tag, value)`` for every number of a train, validation or FP8 numerics record,
    tagged by its kind (``train/loss``, ``val/val_loss``, ``numerics/grad_underflow_pct_max``):
    one chart per metric, nothing picked by hand, so a metric added to the JSONL shows up in
    TensorBoard too. None (e.g. MFU on CPU) is skipped."""
    kind = record.get("kind")
    if kind not in ("train", "val", "numerics"):
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


def _quiet_writer_thread_errors() -> None:
    """TensorBoard's writer thread dies of a full disk with a traceback on stderr, and the main
    thread gets the same OSError at its next write, where TensorBoardLog turns it into one
    warning: leave the thread's copy unprinted (every other thread's error is printed)."""
    hook = threading.excepthook
    if getattr(hook, "quiets_tensorboard", False):
        return

    def excepthook(args: threading.ExceptHookArgs) -> None:
        writer_thread = type(args.thread).__module__.startswith("tensorboard.")
        if not (writer_thread and issubclass(args.exc_type, OSError)):
            hook(args)

    excepthook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = excepthook


class TensorBoardLog:
    """``torch.utils.tensorboard.SummaryWriter`` on rank 0, one of the run's sinks (trackers.py).

    ``resumed_from``: a resumed run passes its checkpoint's step, and TensorBoard drops the
    events after it that the interrupted run wrote (``purge_step``), so the charts show one line,
    not twice the steps between the last checkpoint and the interruption. A fresh run moves an
    earlier run's events to ``tensorboard.N`` (a run of its own in ``tensorboard --logdir``).

    A write the file system refuses (full, quota) ends TensorBoard for the run with one
    warning; training goes on (metrics.jsonl and the log carry the same numbers).
    """

    name = "tensorboard"
    id = None  # nothing for a resume to continue: the events folder is the run's

    def __init__(self, log_dir: str | os.PathLike[str], *, resumed_from: int = 0) -> None:
        # Imported here: only runs that ask for TensorBoard need it importable.
        from torch.utils.tensorboard import SummaryWriter

        from model_utils.report.metrics.records import set_aside

        _quiet_writer_thread_errors()
        aside = None if resumed_from else set_aside(log_dir)
        if aside is not None:  # a fresh run: its own chart, the earlier one beside it
            log.info("An earlier run's TensorBoard events here are kept in %s", aside)
        self.log_dir = str(log_dir)
        log.info(
            "TensorBoard events go to %s; to watch them: %s -m tensorboard.main --logdir %s "
            "(then open http://localhost:6006)",
            self.log_dir,
            sys.executable,  # the Python this run has, with tensorboard installed
            Path(self.log_dir).parent,
        )
        self._writer: Any = SummaryWriter(
            log_dir=self.log_dir,
            purge_step=resumed_from + 1 if resumed_from else None,
            flush_secs=30,
        )

    def flags(self, run: Mapping[str, Any]) -> None:
        self._guarded(lambda w: w.add_text("flags", flags_markdown(run), global_step=0))

    def write(self, record: Mapping[str, Any]) -> None:
        def add(writer: Any) -> None:
            walltime = record.get("time")
            for tag, value in scalars(record):  # a NaN loss is kept: TensorBoard shows it
                writer.add_scalar(tag, value, record["step"], walltime=walltime)
            # At every report, like the JSONL: a preempted or crashed run loses no events.
            writer.flush()

        self._guarded(add)

    def close(self) -> None:
        self._guarded(lambda w: w.close())
        self._writer = None

    def _guarded(self, action: Callable[[Any], None]) -> None:
        if self._writer is None:
            return
        try:
            action(self._writer)
        except OSError as exc:
            writer, self._writer = self._writer, None
            with contextlib.suppress(Exception):  # it fails again: the same full disk
                writer.close()
            words = os_error_words(exc)
            log.warning(
                "TensorBoard: %s cannot be written (%s): no more events this run; training "
                "goes on (metrics.jsonl and this log carry the same numbers)",
                self.log_dir,
                words,
            )
