"""One run per directory: two runs writing one run or checkpoint directory would prune and
overwrite each other's checkpoints, so a live run holds an flock there and any other is refused
in one line (exit 2) before it starts, or at the latest when its rank 0 takes the lock. A folder
inside a live run's folder (its default checkpoints/, say), or one holding a live run's folder,
is refused the same way: the lock covers everything below the folder it is in. Folders are
compared by what they resolve to, so a symlink (or `..`, or another spelling) to a live run's
folder, or to any folder inside it, is that folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from model_utils.config.run_config import Config
from model_utils.errors import Refusal, refuse
from model_utils.parallel import distributed
from model_utils.run import outputs

LOCK_NAME = ".run.lock"
# How far below a run's folders the start-up check looks for a live run's lock: run folders are
# shallow (runs/<name>/checkpoints), and a check must not walk a whole home directory.
SCAN_DEPTH = 3
SCAN_FOLDERS = 2000
# A checkpoint's own folders hold no run: not walked.
_NOT_RUNS = ("step_", ".tmp-", "damaged-", "unverified-")


class RunLocked(Refusal, RuntimeError):
    """Another live process holds the run directory: one line, exit 2."""


def lock_dirs(output_dir: str, checkpoint_dir: str) -> dict[str, Path]:
    """Flag -> directory a run writes into and must own: the run directory, and the checkpoint
    directory when it lies outside it (two runs with one --checkpoint_dir prune each other).
    Inside or not is decided on resolved paths: a link under the run folder to a folder
    elsewhere is elsewhere, and one elsewhere that leads into the run folder is inside."""
    out, ckpt = Path(output_dir).absolute(), Path(checkpoint_dir).absolute()
    owned = {"--output_dir": out}
    real_out, real_ckpt = out.resolve(), ckpt.resolve()
    if real_ckpt != real_out and real_out not in real_ckpt.parents:
        owned["--checkpoint_dir"] = ckpt
    return owned


def _lock_or_holder(fd: int) -> str | None:
    """Take the flock on `fd`: None once it is ours, else who holds it (the lock file's text)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode(errors="replace").strip()
        return text or "another process"
    return None


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
        return _lock_or_holder(fd)
    finally:
        os.close(fd)  # closing releases a probe lock we may have taken


def locks_below(directory: Path) -> Iterator[Path]:
    """Folders strictly below `directory` holding a lock file, breadth first, at most
    SCAN_DEPTH levels and SCAN_FOLDERS folders deep (checkpoint folders are not walked)."""
    todo, walked = [(directory, 0)], 0
    while todo and walked < SCAN_FOLDERS:
        folder, depth = todo.pop(0)
        walked += 1
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name == LOCK_NAME and folder != directory:
                yield folder
            elif depth < SCAN_DEPTH and not entry.name.startswith(_NOT_RUNS):
                if entry.is_dir(follow_symlinks=False):
                    todo.append((Path(entry.path), depth + 1))


def overlap_problem(directory: Path, own: Iterable[Path] = ()) -> str | None:
    """The one line refusing `directory` if a live run other than this one (whose locked
    folders are `own`) holds it, a folder it is inside, or a folder inside it; else None. The
    search runs on the resolved path (links followed), and the line names both spellings when
    they differ."""
    given = Path(directory).absolute()
    directory, mine = given.resolve(), {Path(p).resolve() for p in own}
    shown = str(given) if given == directory else f"{given} (which is {directory})"
    for other in (directory, *directory.parents, *locks_below(directory)):
        holder = None if other in mine else lock_holder(other)
        if holder is None:
            continue
        if other == directory:
            return _locked_message(Path(shown), holder)
        where = "is inside" if other in directory.parents else "holds"
        return (
            f"{shown} {where} {other}, which is in use by another run ({holder}): one run "
            "would prune and overwrite the other's checkpoints; wait for it to end or stop it, "
            "or choose another --output_dir/--checkpoint_dir"
        )
    return None


def check_not_locked(directories: Iterable[Path], own: Iterable[Path] = ()) -> None:
    """Refuse (RunLocked, one line) if a live run holds a directory, a folder it is inside or
    one inside it; `own`: the folders this run has locked. Reads only."""
    for directory in directories:
        refuse(overlap_problem(directory, own), RunLocked)


class RunLock:
    """An exclusive flock on `<directory>/.run.lock`, held for the life of the run.

    The kernel drops the lock when the process dies, however it dies (kill -9, node reboot on a
    local disk, OOM), so a stale lock file never blocks a requeued job: only a live holder does.
    The file's text (pid, host, start time) is only there to name the holder in the refusal.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.fd: int | None = None
        self.created: list[Path] = []  # the folders acquire() made, deepest first

    def acquire(self) -> RunLock:
        self.created = outputs.missing_folders(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            holder = _lock_or_holder(fd)
            if holder is not None:
                os.close(fd)
                raise RunLocked(_locked_message(self.directory, holder))
            if _still_named(fd, self.directory / LOCK_NAME):
                break
            os.close(fd)  # a run that ended removed the file we locked: lock the new one
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        text = f"pid {os.getpid()} on host {socket.gethostname()} since {started}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Unlock; a folder the run left holding nothing but the lock (a run refused after
        start-up: a damaged checkpoint, bad data, no space) is removed with the lock file, as
        are the folders acquire() made for it, so a refusal leaves no empty run folder."""
        if self.fd is None:
            return
        if _only_the_lock(self.directory):
            with contextlib.suppress(OSError):
                os.unlink(self.directory / LOCK_NAME)  # still locked: no one can take it now
            outputs.remove_folders(self.created)  # rmdir: only folders left empty
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _still_named(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd` (not unlinked by a run releasing it)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _only_the_lock(directory: Path) -> bool:
    try:
        return [e.name for e in os.scandir(directory)] == [LOCK_NAME]
    except OSError:
        return False


def hold_run_dirs(config: Config, world: distributed.World) -> list[RunLock]:
    """Rank 0 locks the run's directories for the life of the run; if another live run holds
    one (RunLocked), or the system refuses to create it where access() saw no problem (a full
    file system, root squash, a virtual file system: outputs.WriteProblem), every rank learns
    it (one all-reduce) and all stop, exit 2."""
    locks: list[RunLock] = []
    refused: RunLocked | outputs.WriteProblem | None = None
    if world.is_main:
        try:
            owned = lock_dirs(config.run.output_dir, config.checkpoint.checkpoint_dir)
            for flag, directory in owned.items():
                try:
                    locks.append(RunLock(directory).acquire())
                except OSError as exc:
                    raise outputs.WriteProblem(outputs.unwritable(flag, directory, exc)) from None
            check_not_locked(owned.values(), own=owned.values())  # a run that started since
        except (RunLocked, outputs.WriteProblem) as exc:
            refused = exc
            for lock in locks:
                lock.release()
    if distributed.any_rank(refused is not None):
        raise refused or RunLocked("refused by rank 0")
    return locks
