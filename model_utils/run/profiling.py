"""What a run lets you look inside: ``torch.profiler`` traces of chosen steps on every rank
(``--profile_steps START:END``) and snapshots of CUDA's caching allocator
(``--memory_snapshot_step N``, and at an out-of-memory error).

Why these shapes:
- One window of steady-state steps, with one warm-up step before it (the profiler's first
  recorded step carries its own start-up cost), steps numbered as the log numbers them. A resume
  past the window does not trace it again; a resume inside it traces the steps still to come.
- Outside the window no profiler object exists, so the step is the step without the flag (the
  annotations of ``model_utils/model/annotate.py`` are no-ops then): measured by
  ``benchmarks/bench_profiler_cost.py``.
- A trace is exported to a temporary file, checked whole, compressed to a temporary name on the
  run's disk and renamed into place: a kill or a full disk while it is written never leaves a
  damaged file under the name ``analysis/step_breakdown.py`` reads. A full disk costs the trace
  (one warning), not the run.
- An out-of-memory error in a step becomes one line naming the snapshot (if recorded) and the
  flags that lower memory, instead of a page of traceback; the newest checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model_utils.config.flag_rules import profile_window
from model_utils.errors import Refusal, first_words, os_error_words

log = logging.getLogger("train")

#: Steps recorded as warm-up (not written) before the window, where the run has them.
WARMUP_STEPS = 1
#: Allocator events kept by the memory history (torchtitan's figure): enough for several steps
#: of a large model, a few hundred MB of host memory at most.
SNAPSHOT_MAX_ENTRIES = 100_000
TRACE_SUFFIX = ".pt.trace.json.gz"
#: The key of this module's metadata in a trace (which training step ProfilerStep#0 is), for the
#: analysis that reads the traces back (analysis/traces/).
TRACE_METADATA_KEY = "llama_recipe_profile"
MEMORY_LEVERS = (
    "lower --train_batch_size (--grad_accum_steps keeps the global batch), add "
    "--activation_checkpointing (or --ac_scope mlp for less recompute), keep --chunked_loss=1"
)


class StepOutOfMemory(Refusal, RuntimeError):
    """A step ran out of GPU memory; the message is train.py's one line, said by every rank
    that ran out (it may be one alone), exit 1."""

    exit_code = 1
    every_rank = True


@dataclass(frozen=True)
class Window:
    """Steps first..end this launch profiles: first..active_first-1 warm up, the rest record."""

    first: int
    active_first: int
    end: int


def plan_window(spec: str | None, done: int) -> Window | None:
    """The part of ``--profile_steps`` still ahead of a run that has finished ``done`` steps
    (None: off, or the window passed before this launch)."""
    if spec is None:
        return None
    start, end = profile_window(spec)
    active_first = max(start, done + 1)
    if active_first > end:
        return None
    return Window(max(active_first - WARMUP_STEPS, done + 1), active_first, end)


#: Kineto's progress lines, which its C++ writes to stderr (fd 2) as the profiler starts and
#: stops whatever KINETO_LOG_LEVEL says short of also silencing its errors.
KINETO_PROGRESS = (b"USDT:", b"STAGE:")


@contextlib.contextmanager
def kineto_lines_dropped() -> Iterator[None]:
    """Around a profiler start, step or stop: what is written to fd 2 is held, then passed on
    without Kineto's progress lines (everything else, errors included, unchanged and in
    order). Not in a run's log: noise at every profiled window."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [ln for ln in held.read().splitlines(True) if not ln.startswith(KINETO_PROGRESS)]
            if kept:
                os.write(2, b"".join(kept))


def _whole_json(path: Path) -> bool:
    """Kineto writes the JSON from C++ and does not report a short write: a whole file ends
    with the closing brace of its top-level object."""
    if not path.exists():
        return False
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 64))
        return f.read().rstrip().endswith(b"}")


def write_trace(prof: torch.profiler.profile, path: Path) -> None:
    """The profiler's Chrome trace at ``path``, gzip'd; only a whole trace gets that name.

    Kineto exports the JSON from C++ to the temporary folder (as torch's own ``.gz`` export
    does), where a short write is caught by reading the file's end; Python compresses it onto
    the run's disk under a temporary name and renames it into place. (Exported straight onto a
    full disk, Kineto reported nothing and kept the file open, so the disk could not even be
    unmounted.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=".json")
    os.close(handle)
    raw = Path(name)
    kineto_tmp = raw.with_name(raw.name + ".tmp")  # Kineto's own name while it writes
    packed = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        prof.export_chrome_trace(str(raw))
        if not _whole_json(raw):
            raise OSError("the profiler's export stopped short or wrote nothing (disk full?)")
        with open(raw, "rb") as fin, gzip.open(packed, "wb", compresslevel=6) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        with open(packed, "rb") as f:
            os.fsync(f.fileno())
        os.replace(packed, path)
    finally:
        for leftover in (raw, kineto_tmp, packed):
            leftover.unlink(missing_ok=True)


class RunProfiler:
    """Drives ``--profile_steps`` and ``--memory_snapshot_step`` from train.py's loop:
    ``with RunProfiler(...) as p:`` around the loop, ``p.step(done)`` after each step."""

    def __init__(self, run, rank: int, world_size: int, device: torch.device, done: int) -> None:
        self.output_dir, self.rank, self.world_size = Path(run.output_dir), rank, world_size
        self.device, self.done = device, done
        spec, self.window = run.profile_steps, plan_window(run.profile_steps, done)
        if spec and self.window is None and rank == 0:  # a resume past the window
            log.warning("--profile_steps %s ended before step %d: no trace", spec, done + 1)
        self.snapshot_step = run.memory_snapshot_step
        self._prof: torch.profiler.profile | None = None
        self._dropping = False
        self.written: list[Path] = []

    # -- the loop's calls ------------------------------------------------------------------

    def __enter__(self) -> RunProfiler:
        if self.snapshot_step is not None:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
        self._maybe_start(self.done + 1)
        return self

    def step(self, done: int) -> None:
        """Step ``done`` has finished: move the profiler's schedule on, dump a snapshot due."""
        self.done = done
        if self._prof is not None:
            with kineto_lines_dropped():
                self._prof.step()  # after the window's last step: its trace is written here
            if done >= self.window.end:
                self._close(write=True)
        else:
            self._maybe_start(done + 1)
        if self.snapshot_step and done == self.snapshot_step:
            self._snapshot(f"step_{done}")

    def __exit__(self, exc_type, exc, tb) -> None:
        # A failed step's partial trace is dropped; a stop inside the window (a preemption
        # signal, the end of the run) writes the steps recorded so far.
        self._close(write=exc is None)
        oom = isinstance(exc, torch.OutOfMemoryError)
        snapshot = self._snapshot(f"oom_step_{self.done + 1}") if oom else None
        if self.snapshot_step is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
        if oom:
            raise StepOutOfMemory(self.oom_line(exc, snapshot)) from exc

    # -- traces ----------------------------------------------------------------------------

    def _maybe_start(self, next_step: int) -> None:
        window = self.window
        if window is None or next_step != window.first or self._prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = window.active_first - window.first  # recorded, not written
        active = window.end - window.active_first + 1
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=True,
        )
        meta = {"first_step": window.first, "active_first": window.active_first}
        meta |= {"end": window.end, "rank": self.rank, "world_size": self.world_size}
        self._prof.preset_metadata_json(TRACE_METADATA_KEY, json.dumps(meta))
        with kineto_lines_dropped():
            self._prof.start()

    def _close(self, write: bool) -> None:
        if self._prof is None:
            return
        self._dropping = not write
        prof, self._prof = self._prof, None
        try:
            with kineto_lines_dropped():
                prof.stop()
        except Exception as exc:  # a profiler that cannot stop must not end the run
            log.warning("The profiler did not stop cleanly (%s): no trace from it", exc)

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        window = self.window
        if self._dropping or self.done < window.active_first:
            return  # a failed step's window, or one that stopped before recording anything
        last = min(self.done, window.end)
        steps = f"{window.active_first}-{last}" if last > window.active_first else f"{last}"
        folder = self.output_dir / "profile" / f"step_{window.active_first}"
        path = folder / f"rank_{self.rank}{TRACE_SUFFIX}"
        try:
            write_trace(prof, path)
        except OSError as exc:
            log.warning(
                "The profiler trace of step(s) %s cannot be written to %s (%s): training goes "
                "on without it",
                steps,
                path,
                os_error_words(exc),
            )
            return
        self.written.append(path)
        span = f"{window.active_first}-{window.end}"
        short = "" if last == window.end else f" (the run stopped inside {span})"
        log.info(
            "Profiler trace of step(s) %s%s: %s (one per rank: rank_*%s); read it with "
            "`%s -m analysis.step_breakdown %s`",
            steps,
            short,
            path,
            TRACE_SUFFIX,
            sys.executable,  # the Python this run has: a fresh shell's `python` may not be it
            self.output_dir,
        )

    # -- memory snapshots and OOM ----------------------------------------------------------

    def _snapshot(self, name: str) -> Path | None:
        if self.snapshot_step is None:
            return None
        path = self.output_dir / "memory" / f"{name}_rank_{self.rank}.pickle"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(tmp))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("The memory snapshot %s cannot be written (%s)", path, os_error_words(exc))
            return None
        log.info("CUDA memory snapshot: %s (open it at https://pytorch.org/memory_viz)", path)
        return path

    def oom_line(self, exc: BaseException, snapshot: Path | None) -> str:
        """One line: where, what torch said first, what to change, where the snapshot is."""
        said = first_words(exc)
        where = f"rank {self.rank}: " if self.world_size > 1 else ""
        if snapshot is not None:
            seen = f"memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)"
        else:
            seen = "rerun with --memory_snapshot_step 0 for a snapshot of the allocator at the OOM"
        return (
            f"{where}step {self.done + 1} ran out of GPU memory ({said}); {MEMORY_LEVERS}; "
            f"the newest checkpoint is kept as it was; {seen}"
        )
