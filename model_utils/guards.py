"""Guards that keep a run from losing work: a diverged step never reaches a checkpoint, two
runs never share a run directory, and a location that cannot take the run's output is found
before training, not at the first save.

Every rank must stop at the same step for the same reason, and the host must not wait for the
device at every step. So the checks accumulate on the device (no ``.item()``), and the ranks
agree on them with one small all-reduce at the steps where the loop already waits: report steps
(the loss is synchronised there anyway) and checkpoint saves (a save is itself a collective).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

# Encodes "first non-finite step" so that a MAX all-reduce yields the earliest one over ranks.
_NO_STEP = 2**62


# train.py's exit status when training diverged (2 is bad input, 1 an unexpected error).
EXIT_DIVERGED = 3


class Diverged(RuntimeError):
    """The loss, the gradient norm or the weights stopped being finite: the run cannot go on.

    `latest` is the newest published checkpoint (all finite: every save is checked first)."""

    def __init__(self, step: int, latest: Path | None = None) -> None:
        super().__init__(f"non-finite loss, gradient norm or weights at step {step}")
        self.step, self.latest = step, latest


def diverged_message(step: int, latest: Path | None, lr: float) -> str:
    """One line: what happened, what was kept, what to do."""
    if latest is None:
        where = "no checkpoint was saved; start again"
    else:
        where = f"every checkpoint is finite: resume from the newest, {latest},"
    return (
        f"training diverged: the loss or gradient norm is NaN/inf at step {step}, so the run "
        f"stopped and saved nothing from that step on; {where} with a lower --lr (was {lr:g}) "
        "or a longer --warmup"
    )


def exit_diverged(exc: Diverged, lr: float, is_main: bool) -> None:
    """Rank 0 prints the one line; every rank exits with EXIT_DIVERGED."""
    if is_main:
        print(f"train.py: error: {diverged_message(exc.step, exc.latest, lr)}", file=sys.stderr)
        sys.stderr.flush()
    raise SystemExit(EXIT_DIVERGED)


class StepGuard:
    """Tracks, on the device, the first step whose loss or gradient norm was NaN/inf.

    ``observe`` queues two tiny kernels per step and never synchronises; ``agree`` is the only
    host sync, one all-reduce of two integers that every rank calls at the same steps. The stop
    request (a signal that reached some ranks) rides along in the same all-reduce, so the
    preemption check costs nothing extra either.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet

    def observe(self, step: int, *values: torch.Tensor | None) -> None:
        """Remember `step` if any of `values` (loss, grad norm, ...) is not finite."""
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for value in values:
            if value is not None:
                finite = finite & torch.isfinite(_checkable(value.detach().to(self.device))).all()
        self.first_bad.masked_fill_((self.first_bad == 0) & ~finite, step)

    def observe_weights(self, step: int, params: Iterable[torch.Tensor]) -> None:
        """Before a save: the weights themselves (a finite loss can still leave NaN weights when
        an inf gradient is not clipped). Local shards only: no communication."""
        self.observe(step, *(_local(p) for p in params))

    def agree(self, stop_requested: bool) -> tuple[bool, int | None]:
        """(any rank asked to stop, first non-finite step on any rank or None); all ranks call."""
        bad = torch.where(self.first_bad > 0, _NO_STEP - self.first_bad, 0)
        flags = torch.stack([torch.tensor(int(stop_requested), device=self.device), bad])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, encoded = (int(v) for v in flags.tolist())
        return bool(stop), (_NO_STEP - encoded) if encoded else None


def _checkable(tensor: torch.Tensor) -> torch.Tensor:
    """torch has no isfinite for float8 (an H100 run with torchao's float8 all-gather died on it
    at the final save); fp16 holds every float8 value, NaN and inf included."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.to(torch.float16)
    return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard as a plain tensor (DTensor and float8 wrapper subclasses unwrapped)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


# --------------------------------------------------------------------------------------------
# One run per directory

LOCK_NAME = ".run.lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory: one line, exit 2."""


def lock_dirs(output_dir: str, checkpoint_dir: str) -> list[Path]:
    """The directories a run writes into and must own: the run directory, and the checkpoint
    directory when it lies outside it (two runs with one --checkpoint_dir prune each other)."""
    out, ckpt = Path(output_dir).absolute(), Path(checkpoint_dir).absolute()
    return [out] if ckpt == out or out in ckpt.parents else [out, ckpt]


def _holder_text(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    return text or "another process"


def _locked_message(directory: Path, holder: str) -> str:
    return (
        f"{directory} is in use by another run ({holder}): wait for it to end or stop it, or "
        "choose another --output_dir/--checkpoint_dir"
    )


def lock_holder(directory: str | Path) -> str | None:
    """Who holds `directory`'s run lock ("pid 12 on host n1 since ..."), or None if nobody does.
    Creates nothing: a missing lock file is a free directory. (flock, not fcntl's POSIX locks:
    those are per process, so a probe in the holder's own process would release its lock.)"""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(fd)
    finally:
        os.close(fd)  # closing releases a probe lock we may have taken
    return None


def check_not_locked(directories: Iterable[Path]) -> None:
    """Refuse (RunLocked, one line) before anything starts if a live run holds a directory."""
    for directory in directories:
        holder = lock_holder(directory)
        if holder is not None:
            raise RunLocked(_locked_message(directory, holder))


class RunLock:
    """An exclusive flock on `<directory>/.run.lock`, held for the life of the run.

    The kernel drops the lock when the process dies, however it dies (kill -9, node reboot on a
    local disk, OOM), so a stale lock file never blocks a requeued job: only a live holder does.
    The file's text (pid, host, start time) is only there to name the holder in the refusal.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            raise RunLocked(_locked_message(self.directory, holder)) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on host {socket.gethostname()} since {started}\n".encode(), 0
        )
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --------------------------------------------------------------------------------------------
# Write problems found before training


class WriteProblem(RuntimeError):
    """An output location cannot be written, or cannot hold one checkpoint: one line, exit 2."""


def output_locations(args) -> dict[str, Path]:
    """Where the run writes: flag -> directory."""
    out = {"--output_dir": Path(args.output_dir), "--checkpoint_dir": Path(args.checkpoint_dir)}
    if args.export_hf:
        out["--export_hf"] = Path(args.export_hf)
    return out


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (the folder it would be created in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def location_problem(flag: str, path: Path) -> str | None:
    """Why `path` cannot become a writable directory, found without creating anything: a file
    in the way, or a nearest existing folder that is read-only or not writable by this user."""
    if path.exists() and not path.is_dir():
        return f"{flag} {path} is a file, not a directory: choose another {flag}"
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{flag} {path} cannot be created: {existing} is a file; choose another {flag}"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else "is not writable"
        return f"{flag} {path} cannot be written: {existing} {why}; choose another {flag}"
    return None


def check_locations(locations: dict[str, Path]) -> None:
    """WriteProblem (one line) for the first location that cannot be written. Reads only."""
    for flag, path in locations.items():
        problem = location_problem(flag, path)
        if problem:
            raise WriteProblem(problem)


def probe_write(flag: str, path: Path) -> str | None:
    """Create `path` and write, sync and delete a small file in it: what the run will do, so
    what access() cannot tell (quotas, NFS root squash, ACLs) shows now. None if it worked."""
    probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        words = os.strerror(exc.errno) if exc.errno else str(exc)
        return f"{flag} {path} cannot be written ({words}): choose another {flag}"
    finally:
        for folder in created:  # deepest first: leave nothing behind (it is made when needed)
            try:
                folder.rmdir()
            except OSError:
                break
    return None


# A checkpoint holds fp32 weights (4 bytes per parameter) and the optimizer's two moments:
# fp32 for AdamW, about a byte each for 8-bit/FP8 moments; the rest (schedule, data position,
# RNG) is small.
WEIGHT_BYTES_PER_PARAM = 4
MOMENT_BYTES_PER_PARAM = {"adamw": 8, "adamw8bit": 2, "adamw_fp8": 2}
EXPORT_BYTES_PER_PARAM = 4  # --export_hf writes fp32 safetensors


def checkpoint_bytes(num_params: int, optimizer: str = "adamw") -> int:
    return num_params * (WEIGHT_BYTES_PER_PARAM + MOMENT_BYTES_PER_PARAM.get(optimizer, 8))


def space_verdict(free: int, need: int, keep: int, what: str, where: Path) -> tuple[str, str]:
    """('refuse' | 'warn' | 'ok', one line) for `need` bytes per save with `keep` saves on disk
    at once (a new checkpoint is written before the oldest is pruned)."""
    gib = 2**30
    if free < need:
        return "refuse", (
            f"{where} has {free / gib:.2f} GiB free, less than one {what} "
            f"(~{need / gib:.2f} GiB): free space or choose another location"
        )
    if keep and free < need * keep:
        return "warn", (
            f"{where} has {free / gib:.2f} GiB free, less than the {keep} {what}s this run keeps "
            f"at once (~{need * keep / gib:.2f} GiB): a later save may fail (the newest "
            "checkpoint is then kept)"
        )
    return "ok", ""


def check_space(args, num_params: int, log) -> None:
    """Before training: WriteProblem if a checkpoint (or the HF export) cannot fit once; a
    warning if keep_last + 1 checkpoints cannot."""
    # Checked even with --checkpoint_freq -1: a preemption signal still saves. keep_last 0 keeps
    # every checkpoint: warn below two.
    keep = args.keep_last + 1 if args.keep_last else 2
    size = checkpoint_bytes(num_params, getattr(args, "optimizer", "adamw"))
    needs = [("checkpoint", size, keep, Path(args.checkpoint_dir))]
    if args.export_hf:
        needs.append(
            ("Hugging Face export", EXPORT_BYTES_PER_PARAM * num_params, 1, Path(args.export_hf))
        )
    for what, need, keep, where in needs:
        free = shutil.disk_usage(_nearest_existing(where)).free
        verdict, line = space_verdict(free, need, keep, what, where)
        if verdict == "refuse":
            raise WriteProblem(line)
        if verdict == "warn":
            log.warning(line)
