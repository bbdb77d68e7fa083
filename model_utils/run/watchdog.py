"""A hang explained: a per-rank watchdog that, when no step completes for ``--hang_timeout``
seconds, writes every thread's Python stack to ``<output_dir>/hang/stacks.rank<R>.txt`` (and, on
NCCL, the Flight Recorder's record of the recent collectives), names the file in the log and
ends the rank, so the job ends the way a dead rank ends it: its peers see the connection drop,
torchrun stops the rest, and the newest checkpoint is the one to resume from.

The watchdog is a daemon thread that wakes once a second and compares the time since the last
completed step with the limit; a step only stores the time (no syscall, no lock). Checkpoint
saves, validation and the end of the run are left out (:meth:`Watchdog.paused`), so only the
training steps are timed. Without ``--hang_timeout`` the limit is 20x the slowest step time the
run has measured, never under 300 s, so a first step that compiles or a slow step never trips
it, while a hang in a collective is caught before ``--dist_timeout`` (default 600 s) ends the
ranks without stacks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

log = logging.getLogger("train")

#: The shortest limit of the default: a torch.compile'd first step, a slow file system.
HANG_FLOOR_S = 300.0
#: The default limit in measured step times.
HANG_STEP_FACTOR = 20
#: train.py's exit status when its watchdog ended a hung rank (2 bad input, 3 diverged).
EXIT_HUNG = 4
#: Flight Recorder ring buffer: the last N collectives per process group (a few hundred bytes
#: each: about 1 MB per rank with their Python stacks).
FLIGHT_RECORDER_ENTRIES = 2000


def auto_limit(step_seconds: float | None) -> float:
    """The default limit: HANG_STEP_FACTOR x the slowest measured step, at least the floor."""
    if step_seconds is None:
        return HANG_FLOOR_S
    return max(HANG_FLOOR_S, HANG_STEP_FACTOR * step_seconds)


#: The first torch that reads TORCH_FR_* (and warns, on every rank's stderr, about the older
#: TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE names it still honours).
FR_NAMES_SINCE = (2, 7)


def torch_release() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def flight_recorder_env(
    output_dir: str | os.PathLike[str],
    env: Mapping[str, str],
    release: tuple[int, int] | None = None,
) -> dict[str, str]:
    """The variables that turn on PyTorch's NCCL Flight Recorder into the run folder, under the
    names this torch ``release`` reads (values the user set, under either name, are kept)."""
    size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    size = size or str(FLIGHT_RECORDER_ENTRIES)
    # <run>/flight_recorder/rank_: PyTorch appends the rank; torchfrtrace reads the folder
    default = Path(output_dir).absolute() / "flight_recorder" / "rank_"
    prefix = flight_recorder_file(env) or str(default)
    new = (release or torch_release()) >= FR_NAMES_SINCE
    size_name = "TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    file_name = "TORCH_FR_DUMP_TEMP_FILE" if new else "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
    return {
        size_name: size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
        file_name: prefix,
    }


def flight_recorder_file(env: Mapping[str, str]) -> str | None:
    """The dump prefix in effect, under either name."""
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def enable_flight_recorder(output_dir: str, rank: int) -> Path:
    """Before the NCCL process group starts: set the variables, make the folder; the file this
    rank's dump will have."""
    os.environ.update(flight_recorder_env(output_dir, os.environ))
    prefix = Path(flight_recorder_file(os.environ))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return Path(f"{prefix}{rank}")


def dump_flight_recorder(rank: int) -> Path | None:
    """This rank's Flight Recorder entries written where a timeout would write them; None
    without NCCL (or with the recorder off)."""
    prefix = flight_recorder_file(os.environ)
    if not prefix:
        return None
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:  # a build without NCCL
        return None
    path = Path(f"{prefix}{rank}")
    path.write_bytes(dump())
    return path


class Watchdog:
    """Ends this rank with its stacks on disk when no step completes for the limit.

    ``limit``: seconds, or None for :func:`auto_limit` of the measured step times, or 0 (off).
    ``flight_recorder``: also dump the NCCL Flight Recorder when it fires."""

    def __init__(
        self, limit: float | None, output_dir: str, rank: int, flight_recorder: bool = False
    ) -> None:
        self.auto = limit is None
        self.limit = auto_limit(None) if limit is None else limit
        self.enabled = self.limit > 0
        self.path = Path(output_dir) / "hang" / f"stacks.rank{rank}.txt"
        self.rank, self.flight_recorder = rank, flight_recorder
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, waiting: str = "training step") -> None:
        """Watch from now on; `waiting` names what a rank past the limit is stuck in."""
        self.waiting = waiting
        if not self.enabled:
            return
        self._last = time.monotonic()
        self._stop.clear()  # a watch closed before (the preflight's) ended only itself
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        if waiting != "training step":
            return
        how = "20x the measured step time, at least" if self.auto else "--hang_timeout"
        log.info(
            "hang watchdog: no step done in %.0f s (%s) writes every rank's stacks to %s and "
            "ends the job",
            self.limit,
            how,
            self.path.parent / "stacks.rank<R>.txt",
        )

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """`what` before training (the preflight's collectives) timed as a step is: a rank
        stuck in it ends at the limit with its stacks and a line naming it, not at
        --dist_timeout with neither."""
        self.start(what)
        try:
            yield
        finally:
            self.close()

    def step_done(self) -> None:
        self._last = time.monotonic()

    def measured(self, step_seconds: float) -> None:
        """A report's time per step: the default limit follows the slowest seen."""
        if self.auto:
            self.limit = max(self.limit, auto_limit(step_seconds))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not a training step (a save, validation): not timed; the clock restarts after."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            idle = time.monotonic() - self._last
            if not self._paused and idle > self.limit:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        """Stacks to the file, one line to the log, the rank ends (no Python cleanup: the main
        thread is the one stuck)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as out:
            out.write(f"rank {self.rank}: no {self.waiting} done for {idle:.0f} s\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        recorder = None
        if self.flight_recorder:
            with contextlib.suppress(Exception):  # the stacks are out already; this is extra
                recorder = dump_flight_recorder(self.rank)
        extra = f"; NCCL Flight Recorder in {recorder}" if recorder else ""
        log.error(
            "hang: rank %d did no %s for %.0f s (limit %.0f s): its Python stacks "
            "are in %s%s; ending this rank (exit %d) so the job ends; resume from the newest "
            "checkpoint",
            self.rank,
            self.waiting,
            idle,
            self.limit,
            self.path,
            extra,
            EXIT_HUNG,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_HUNG)


def for_run(run, rank: int, device) -> Watchdog:
    """The watchdog of a run's RunConfig, dumping the Flight Recorder on CUDA (NCCL records it)."""
    return Watchdog(run.hang_timeout, run.output_dir, rank, flight_recorder=device.type == "cuda")
