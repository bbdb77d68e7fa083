"""The step meter: steps between two log lines timed by the wall clock between two device
syncs, turned into throughput figures, and the time-left estimate."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from model_utils.model.annotate import OUTSIDE_STEP, annotate
from model_utils.report.metrics.device import GIB


def step_metrics(
    *,
    step: int,
    loss: float,
    lr: float,
    step_seconds: float,
    data_wait_seconds: float,
    samples: int,
    tokens: int,
    world_size: int,
    peak_memory_bytes: int,
    flops_per_token: float,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Throughput metrics of one step (or of a window of steps: pass the window sums).

    ``samples``/``tokens`` are global; ``step_seconds`` is the whole step including data wait.
    ``mfu`` is a percentage of ``peak_tflops`` (bf16 dense) or None when no peak is known.
    """
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens_per_sec_per_device = tokens / step_seconds / world_size
    tflops_per_device = flops_per_token * tokens_per_sec_per_device / 1e12
    mfu = None if peak_tflops is None else 100.0 * tflops_per_device / peak_tflops
    return {
        "kind": "train",
        "step": step,
        "samples": samples,
        "tokens": tokens,
        "loss": float(loss),
        "lr": float(lr),
        "step_seconds": step_seconds,
        "samples_per_sec": samples / step_seconds,
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "tflops_per_device": tflops_per_device,
        "mfu": mfu,
        "peak_mem_gib": peak_memory_bytes / GIB,
        "data_wait_pct": 100.0 * data_wait_seconds / step_seconds,
    }


@dataclass
class StepMeter:
    """Times windows of steps between two log lines by the wall clock between two device syncs.

    A GPU runs behind the host: a step's kernels are only paid for when something waits for
    them. Summing per-step host intervals therefore drops whatever the device still owed when an
    interval ended, so the speed logged above ``--logging_freq 1`` runs ahead of the real one
    (by how much on an H100: docs/failures.md, "Where the rules came from"). Here a
    window's time is, by construction, ``clock()`` after a ``sync()`` at :meth:`report` minus
    ``clock()`` after the ``sync()`` that ended the previous window (or :meth:`start`): all device
    work queued in between is inside it, whenever it ran. Work that is not training (validation,
    checkpoint saves) runs inside :meth:`paused`, which syncs at both ends and subtracts its time.

    ``add_step`` only counts (no clock, no sync), so steps between log lines never wait for the
    device. ``sync`` and ``clock`` are injectable so tests can simulate an asynchronous device.

    Each report also carries the run's time (``elapsed_before`` plus the time since
    :meth:`start`) and, given ``max_steps``, an estimate of the time left
    (:func:`remaining_seconds`) from the windows after this process's first ``warmup_steps``
    steps (a resumed run warms up again; a window holding any of them is warm-up).
    """

    flops_per_token: float
    world_size: int
    peak_tflops: float | None
    peak_label: str = ""
    memory_label: str = ""
    sync: Callable[[], None] = field(default=lambda: None, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    max_steps: int | None = None
    warmup_steps: int = 0
    elapsed_before: float = 0.0  # the run's earlier launches (a resume's checkpoint says)
    _started: float | None = field(default=None, init=False)
    _counted: int = field(default=0, init=False)
    _step_times: list[float] = field(default_factory=list, init=False, repr=False)
    _window_start: float | None = field(default=None, init=False)
    _paused: float = field(default=0.0, init=False)
    _data_wait: float = field(default=0.0, init=False)
    _samples: int = field(default=0, init=False)
    _tokens: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)

    def start(self) -> None:
        """Open the first window (call once, right before the first step)."""
        self.sync()
        self._window_start = self._started = self.clock()

    def elapsed(self, now: float | None = None) -> float:
        """The run's wall-clock seconds: its earlier launches' and this one's since start()."""
        if self._started is None:
            return self.elapsed_before
        return self.elapsed_before + (self.clock() if now is None else now) - self._started

    def add_step(self, *, data_wait_seconds: float, samples: int, tokens: int) -> None:
        if self._window_start is None:
            raise RuntimeError("StepMeter.start() must be called before the first step")
        self._data_wait += data_wait_seconds
        self._samples += samples
        self._tokens += tokens
        self._steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the enclosed work (validation, a checkpoint save) out of the window's time (and
        out of a profiled step: the ``outside_step`` range)."""
        self.sync()
        begin = self.clock()
        try:
            with annotate(OUTSIDE_STEP):
                yield
        finally:
            self.sync()
            self._paused += self.clock() - begin

    def report(
        self, *, step: int, loss: float, lr: float, peak_memory_bytes: int
    ) -> dict[str, Any]:
        """Metrics of the steps added since the last report; closes the window, opens the next."""
        if self._steps == 0 or self._window_start is None:
            raise RuntimeError("StepMeter.report() called before any add_step()")
        self.sync()
        now = self.clock()
        seconds = now - self._window_start - self._paused
        metrics = step_metrics(
            step=step,
            loss=loss,
            lr=lr,
            step_seconds=seconds,
            data_wait_seconds=self._data_wait,
            samples=self._samples,
            tokens=self._tokens,
            world_size=self.world_size,
            peak_memory_bytes=peak_memory_bytes,
            flops_per_token=self.flops_per_token,
            peak_tflops=self.peak_tflops,
        )
        metrics["window_steps"] = self._steps
        # Wall-clock time of the report: consecutive records give the real elapsed time,
        # including what the window leaves out (validation, checkpoint saves).
        metrics["time"] = time.time()
        metrics["mfu_basis"] = self.peak_label
        metrics["memory_kind"] = self.memory_label
        # a window holding any of this launch's first steps is warm-up: out of the estimate,
        # and out of the summary's medians (records' speed_warmup)
        metrics["speed_warmup"] = self._counted < self.warmup_steps
        self._counted += self._steps
        if not metrics["speed_warmup"]:
            self._step_times.append(seconds / self._steps)
        metrics["elapsed_seconds"] = self.elapsed(now)  # validation and saves included
        metrics["remaining_seconds"] = (
            None
            if self.max_steps is None
            else remaining_seconds(self._step_times, self.max_steps - step)
        )
        self._window_start, self._paused, self._data_wait = now, 0.0, 0.0
        self._samples = self._tokens = self._steps = 0
        return metrics


def remaining_seconds(step_times: Sequence[float], steps_left: int) -> float | None:
    """Median seconds per step x steps left; None while no window after warm-up exists.

    The median, not the mean, so one slow window (a checkpoint flush, a straggler) does not swing
    the estimate of a multi-day job. Validation and checkpoint time are not in ``step_times``
    (the meter pauses for them), so the estimate is of training time alone.
    """
    return statistics.median(step_times) * max(steps_left, 0) if step_times else None
