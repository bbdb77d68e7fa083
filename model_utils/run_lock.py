"""One run per directory: two runs writing one run or checkpoint directory would prune and
overwrite each other's checkpoints, so a live run holds an flock there and any other is refused
in one line (exit 2) before it starts, or at the latest when its rank 0 takes the lock.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from model_utils import distributed, outputs

LOCK_NAME = ".run.lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory: one line, exit 2."""


def lock_dirs(output_dir: str, checkpoint_dir: str) -> dict[str, Path]:
    """Flag -> directory a run writes into and must own: the run directory, and the checkpoint
    directory when it lies outside it (two runs with one --checkpoint_dir prune each other)."""
    out, ckpt = Path(output_dir).absolute(), Path(checkpoint_dir).absolute()
    owned = {"--output_dir": out}
    if ckpt != out and out not in ckpt.parents:
        owned["--checkpoint_dir"] = ckpt
    return owned


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


def hold_run_dirs(
    args: argparse.Namespace, world: distributed.World, device: torch.device
) -> list[RunLock]:
    """Rank 0 locks the run's directories for the life of the run; if another live run holds
    one (RunLocked), or the system refuses to create it where access() saw no problem (a full
    file system, root squash, a virtual file system: outputs.WriteProblem), every rank learns
    it (one all-reduce) and all stop, exit 2."""
    locks: list[RunLock] = []
    refused: RunLocked | outputs.WriteProblem | None = None
    if world.is_main:
        try:
            for flag, directory in lock_dirs(args.output_dir, args.checkpoint_dir).items():
                try:
                    locks.append(RunLock(directory).acquire())
                except OSError as exc:
                    raise outputs.WriteProblem(outputs.unwritable(flag, directory, exc)) from None
        except (RunLocked, outputs.WriteProblem) as exc:
            refused = exc
            for lock in locks:
                lock.release()
    if distributed.all_ranks_agree(refused is not None, device):
        raise refused or RunLocked("refused by rank 0")
    return locks
