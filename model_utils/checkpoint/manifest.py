"""A checkpoint directory on disk: names, the marker, checksums, the one verdict on a checkpoint,
the one rule for which checkpoint a resume takes, publishing and pruning; and why a checkpoint
cannot be used or written, in one line.

Safe before any process group exists: the collectives below are a world of one without one.
The rule for a complete checkpoint is published.py's, shared with the launcher.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from model_utils.checkpoint.published import (  # noqa: F401 (re-exported: the package's names)
    DCP_METADATA,
    MARKER,
    TMP_PREFIX,
    checkpoint_name,
    checkpoint_problem,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    step_dirs,
    step_of,
)
from model_utils.errors import Refusal, UsageError, first_line, refuse, write_whole
from model_utils.parallel.distributed import (
    all_gather_object,
    current_rank,
    first_problem,
    world_size,
)

#: 2: TE's FP8 scaling state as plain tensors (item fp8_scaling), no pickled ``_extra_state``.
#: A checkpoint of any other format is refused (format_problem).
CHECKPOINT_FORMAT = 2
DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed its checks, renamed by an `auto` resume
# A checkpoint without checksums for every file (saved before they were recorded, or the table
# removed), newer than the one an `auto` resume starts from: kept, out of resume and pruning.
UNVERIFIED_PREFIX = "unverified-"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger(__name__)


# ---- Reading a checkpoint without running anything it holds

#: The globals a DCP checkpoint's `.metadata` pickle names (torch's own records of its tensors
#: and files); any other is refused before it is called. DCP's reader runs pickle.load.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
}
try:  # numpy 2 moved it; the RNG state's generator array pickles through it
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1 (an older container)
    from numpy.core.multiarray import _reconstruct
#: What a checkpoint's packed values (step, schedule, data position, RNG) hold besides plain
#: data and tensors, for torch.load(weights_only=True): numpy's RNG state.
PACKED_GLOBALS = [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def _enum_member(kind: Any, name: str) -> enum.Enum:
    """The one `getattr` a metadata pickle may call: Python >= 3.12 pickles an enum member (DCP's
    memory-format record) as getattr(its class, its name)."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and name in kind.__members__:
        return kind[name]
    raise pickle.UnpicklingError(f"it asks for {kind!r}.{name}, which no DCP metadata holds")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no DCP metadata holds")


def read_metadata(path: str | Path) -> Metadata:
    """Checkpoint `path`'s DCP metadata, unpickled with only the classes DCP writes there: a
    `.metadata` replaced by another pickle is refused without running it (its checksum in the
    marker is no obstacle to whoever can write the folder)."""
    with open(Path(path) / DCP_METADATA, "rb") as fh:
        metadata = _MetadataUnpickler(fh).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, its metadata read by read_metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    """DCP's load planner, each non-tensor value checked by torch's weights-only unpickler
    (plain data, tensors, PACKED_GLOBALS) before DCP's own load of it (weights_only=False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(PACKED_GLOBALS):
            torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def load(items: dict[str, Any], path: str | Path, **options: Any) -> None:
    """dcp.load of `items` from checkpoint `path`, running nothing the folder holds."""
    dcp.load(items, storage_reader=_Reader(str(path)), planner=_Planner(), **options)


# ---- Why a checkpoint cannot be used or written


class ResumeRefused(Refusal, ValueError):
    """The checkpoint belongs to another run, is damaged, or would be overwritten: one line."""


class CheckpointWriteError(Refusal, RuntimeError):
    """A save failed (disk full, read-only, permissions, ...): one line saying why and what was
    kept, exit 1 (the run failed, not its input). The temporary directory is removed; published
    checkpoints are never touched."""

    exit_code = 1


_WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "a file would exceed the size limit (ulimit -f)",
}
_NEARLY_FULL_BYTES = 16 * 2**20


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank exceptions inside DCP's
    CheckpointException (which wraps each as (exception, traceback))."""
    todo, seen = [exc], set()
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__]
        if isinstance(err, CheckpointException):
            todo += [pair[0] for pair in err.failures.values()]


def write_error_reason(exc: BaseException, directory: Path) -> str:
    """Why a save failed, in words: the errno of an OSError anywhere in the chain, else a full
    disk if the directory has next to no free space (torch's zip writer reports ENOSPC as
    "unexpected pos ..."), else the first line of the error."""
    chain = list(_exception_chain(exc))
    for err in chain:
        if isinstance(err, OSError) and err.errno is not None:
            words = _WRITE_ERRNOS.get(err.errno, os.strerror(err.errno))
            return f"{words} ({err.filename or directory})"
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(directory).free
        if free < _NEARLY_FULL_BYTES:
            return f"no space left on the device ({free / 2**20:.1f} MiB free in {directory})"
    return first_line(chain[-1] if chain else exc)


def read_marker(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text())


def format_problem(path: str | Path, marker: Mapping[str, Any]) -> str | None:
    """Why checkpoint `path` (its marker: `marker`) is of a format this recipe does not load, or
    None. Format 1 held TE's FP8 state as a pickle; its weights still convert to HF. Anything
    else that is not this recipe's format (a newer one, null, 1.5, text) is refused too: loading
    it would read a layout nobody checked."""
    saved = marker.get("format", CHECKPOINT_FORMAT)
    if type(saved) is int and saved == CHECKPOINT_FORMAT:
        return None
    if type(saved) is int and 0 < saved < CHECKPOINT_FORMAT:
        return (
            f"checkpoint {path} is in checkpoint format {saved}, which this recipe no longer "
            f"loads (it loads format {CHECKPOINT_FORMAT}): convert its weights with "
            f"scripts/convert_checkpoint.py {path} DIR and start a new run from them with "
            "--init_from_hf DIR"
        )
    return (
        f"checkpoint {path} says checkpoint format {json.dumps(saved)} in its {MARKER}, which "
        f"this recipe does not load (it loads format {CHECKPOINT_FORMAT}): resume it with the "
        "recipe version that saved it, or start a new run"
    )


def loadable_marker(path: str | Path) -> dict[str, Any]:
    """The marker of checkpoint `path`, for a load: ValueError (one line) unless the checkpoint
    is complete, ResumeRefused if it is of an older format."""
    refuse(checkpoint_problem(path), ValueError)
    marker = read_marker(path)
    refuse(format_problem(path, marker), ResumeRefused)
    return marker


def save_paths(checkpoint_dir: Path, step: int) -> tuple[Path, Path]:
    """(the temporary folder a save of `step` writes into, the name it is published under)."""
    final = checkpoint_dir / checkpoint_name(step)
    return checkpoint_dir / (TMP_PREFIX + final.name), final


# ---- Integrity: every file's size and checksum in the marker, checked before a resume

SUM_ALGORITHM = "sha256"  # ~1.5 GB/s per core with SHA extensions; each rank sums its own files


def own_file_sums(directory: Path) -> dict[str, dict[str, Any]]:
    """The sums of the files this rank wrote into a DCP save: its shards, which DCP's
    FileSystemWriter names `__<rank>_<n>.distcp`, and on rank 0 the `.metadata`."""
    files = sorted(Path(directory).glob(f"__{current_rank()}_*.distcp"))
    return file_sums(files + [Path(directory) / DCP_METADATA] if current_rank() == 0 else files)


def file_sums(files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """name -> {"bytes", "sha256"}: what the marker records for each file."""
    out = {}
    for path in files:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, SUM_ALGORITHM).hexdigest()
        out[path.name] = {"bytes": path.stat().st_size, SUM_ALGORITHM: digest}
    return out


def recorded_sums(marker: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The marker's file table, only its well-formed entries (name -> {"bytes": int, "sha256":
    64 hex digits}): what the size and checksum checks can rely on. Anything else in it (a list,
    an entry without its checksum, a size that is not a number) proves nothing."""
    files = marker.get("files")
    if not isinstance(files, dict):
        return {}
    return {name: dict(sums) for name, sums in files.items() if _entry_problem(sums) is None}


def _entry_problem(sums: Any) -> str | None:
    """What is wrong with one file's entry in the marker's table, or None."""
    if not isinstance(sums, dict):
        return "an entry that is not {bytes, sha256}"
    size, digest = sums.get("bytes"), sums.get(SUM_ALGORITHM)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return "no size"
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        return f"no {SUM_ALGORITHM}"
    return None


def needed_files(path: Path, metadata: Any) -> list[str]:
    """Every file a load of checkpoint `path` reads: the .metadata, the shards its `metadata`
    names, and any other shard in the folder."""
    names = {p.name for p in path.glob("*.distcp")}
    names |= {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
    return [DCP_METADATA, *sorted(names)]


def content_damage(path: str | Path, files: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first of `files` (well-formed entries: recorded_sums) whose content no longer matches
    its checksum, or that cannot be read (gone since the cheap checks, an I/O error): a line,
    not an exception, because the ranks split the files and one rank raising would leave the
    others waiting in the gather of everyone's verdict."""
    for name, saved in files.items():
        file = Path(path) / name
        try:
            now = file_sums([file])[name]
        except OSError as exc:
            return f"{file} cannot be read ({first_line(exc)})"
        if now[SUM_ALGORITHM] != saved[SUM_ALGORITHM]:
            return f"{file} does not match its {SUM_ALGORITHM} (changed since the save)"
    return None


# ---- The one verdict and the one resolver

INCOMPLETE, DAMAGED, UNVERIFIED = "incomplete", "damaged", "unverified"


@dataclass(frozen=True)
class Problem:
    """What is wrong with a checkpoint: `kind` says how bad (incomplete: no finished save;
    damaged: a file missing, cut short, changed or unreadable; unverified: loadable, but no
    checksum proves its bytes) and `why` says it in one line naming the file."""

    kind: str
    why: str

    def __str__(self) -> str:
        return self.why

    @property
    def prefix(self) -> str:
        """The name an `auto` resume sets such a checkpoint aside under."""
        return UNVERIFIED_PREFIX if self.kind == UNVERIFIED else DAMAGED_PREFIX


def inspect_checkpoint(path: str | Path, checksums: bool = False) -> Problem | None:
    """What is wrong with checkpoint `path`, or None for a complete, sound and verified one.

    Without `checksums` it reads the marker and the metadata, not the tensors (safe before any
    process group). With `checksums` (all ranks call) every file's sha256 is compared too, the
    files split over the ranks so each is read once, and every rank gets the same verdict:
    damage on any rank outweighs an unverified table."""
    path = Path(path)
    problem = _cheap_verdict(path)
    if not checksums:
        return problem
    if problem is None or problem.kind == UNVERIFIED:
        files = sorted(recorded_sums(read_marker(path)).items())
        damage = content_damage(path, dict(files[current_rank() :: world_size()]))
        problem = Problem(DAMAGED, damage) if damage else problem
    damaged = None if problem is None or problem.kind == UNVERIFIED else problem
    return first_problem(damaged) or problem  # any rank's damage, else this table's verdict


def _cheap_verdict(path: Path) -> Problem | None:
    """The verdict of the checks that read no tensors, in one walk over the files a load reads
    and the marker's table. Damaged: marker or .metadata unreadable, a file missing, a recorded
    one at another size. Else unverified: a file a load reads has no well-formed size and
    sha256 recorded, so it could be corrupted without a sign; such a checkpoint is never
    trusted unnamed (an `auto` resume and the converter pass it by) and never takes a verified
    one's place in keep-last."""
    incomplete = checkpoint_problem(path)
    if incomplete:
        return Problem(INCOMPLETE, incomplete)
    try:
        marker = read_marker(path)
        int(marker["step"])
    except Exception as exc:
        return Problem(
            DAMAGED, f"{path / MARKER} is not a valid checkpoint marker ({first_line(exc)})"
        )
    try:
        metadata = read_metadata(path)
    except Exception as exc:
        return Problem(DAMAGED, f"{path / DCP_METADATA} cannot be read ({first_line(exc)})")
    table, sums, needed = marker.get("files"), recorded_sums(marker), needed_files(path, metadata)
    unverified = None if table and isinstance(table, dict) else "no checksums"
    for name in [*needed, *(n for n in sums if n not in needed)]:
        file, saved = path / name, sums.get(name)
        if not file.is_file():
            return Problem(DAMAGED, f"{file} is missing")
        size = file.stat().st_size
        if saved is not None and size != saved["bytes"]:
            why = f"{file} has {size} bytes, {saved['bytes']} were saved (truncated or overwritten)"
            return Problem(DAMAGED, why)
        if saved is None and unverified is None:
            problem = _entry_problem(table[name]) if name in table else "no checksum"
            unverified = f"{problem} for {name}"
    if unverified is None:
        return None
    return Problem(UNVERIFIED, f"{path / MARKER} records {unverified}")


def checkpoint_to_resume(
    resume_from_checkpoint: str | None, checkpoint_dir: str | Path, verify: bool = True
) -> Path | None:
    """The checkpoint `--resume_from_checkpoint` resumes: the one rule for it.

    None/'' -> None. PATH -> PATH: one that is not complete is a ValueError, a damaged one a
    ResumeRefused (one line naming the file); an unverified one loads, as named. 'auto' -> the
    newest sound, verified checkpoint in `checkpoint_dir`, passing newer damaged or unverified
    ones by; ResumeRefused if there are checkpoints but none such; None (a fresh start) if there
    are none at all.

    verify=False is the check before any process group: no tensor bytes read, nothing renamed.
    verify=True is the resume (all ranks call): every file's checksum too, rank 0's listing for
    every rank, a warning for an unverified PATH, and each checkpoint an `auto` resume passes
    by set aside with a warning (`damaged-`, `unverified-`)."""
    if not resume_from_checkpoint:
        return None
    check_resume_arg(resume_from_checkpoint)  # a PATH that is not complete: UsageError
    if resume_from_checkpoint != "auto":
        path = _named(Path(resume_from_checkpoint), verify)
    else:
        path = _newest_sound(Path(checkpoint_dir), verify)
    shared = path and verify and current_rank() == 0 and writable_by_others(path)
    if shared:
        log.warning(
            "%s can be written by other users (mode %o): whoever writes there changes what "
            "this resume loads; `chmod go-w %s` keeps it yours",
            shared,
            shared.stat().st_mode & 0o777,
            shared,
        )
    return path


def writable_by_others(path: Path) -> Path | None:
    """The checkpoint, its checkpoint folder or its run folder where users other than the
    owner may write (a group or world write bit; not a sticky folder such as /tmp, where they
    cannot replace what is yours), or None."""
    for folder in (path, path.parent, path.parent.parent):
        with contextlib.suppress(OSError):
            if (folder.stat().st_mode & 0o1022) in (0o002, 0o020, 0o022):
                return folder
    return None


def _newest_sound(checkpoint_dir: Path, verify: bool) -> Path | None:
    """`auto`'s checkpoint (checkpoint_to_resume says the rule)."""
    found = step_dirs(checkpoint_dir)
    if verify:
        found = all_gather_object(found)[0]  # rank 0's
    passed: list[tuple[Path, Problem]] = []
    for path in reversed(found):
        problem = inspect_checkpoint(path, checksums=verify)
        if problem is None:
            if verify and passed:
                set_aside_all(passed)
                if current_rank() == 0:
                    log.warning("Resuming from %s, the newest verified checkpoint", path)
            return path
        passed.append((path, problem))
    if not passed:
        return None
    # none set aside: the same command (a requeue) must meet the same refusal, not a fresh start
    raise ResumeRefused(no_sound_checkpoint(checkpoint_dir, passed))


def _named(path: Path, verify: bool) -> Path:
    """A complete checkpoint given by path: refused unless sound; unverified is allowed."""
    problem = inspect_checkpoint(path, checksums=verify)
    if problem is None:
        return path
    if problem.kind != UNVERIFIED:  # damaged (or gone incomplete since the check)
        raise ResumeRefused(f"--resume_from_checkpoint {path} is damaged: {problem}")
    if verify and current_rank() == 0:
        log.warning("Loading %s unverified, as named: %s", path, problem)
    return path


def check_resume_arg(resume_from_checkpoint: str | None) -> None:
    """UsageError (one line) for a checkpoint named by path that is not complete: the flag's
    own check, reading no file's contents."""
    if resume_from_checkpoint and resume_from_checkpoint != "auto":
        problem = checkpoint_problem(resume_from_checkpoint)
        if problem:
            raise UsageError(f"--resume_from_checkpoint: {problem}")


def no_sound_checkpoint(checkpoint_dir: str | Path, passed: list[tuple[Path, Problem]]) -> str:
    """The refusal when an `auto` resume found checkpoints but none sound and verified."""
    unverified = [(path, p.why) for path, p in passed if p.kind == UNVERIFIED]
    if not unverified:
        return (
            f"every checkpoint in {checkpoint_dir} is damaged (newest: {passed[0][1]}): restore "
            "one from a copy, or pass --overwrite_output_dir without --resume_from_checkpoint "
            "to start afresh"
        )
    path, why = unverified[0]
    return (
        f"no checkpoint in {checkpoint_dir} is verified (newest unverified: {why}): to load "
        f"{path} without checking its bytes, name it with --resume_from_checkpoint {path}; or "
        "pass --overwrite_output_dir without --resume_from_checkpoint to start afresh"
    )


def set_aside(path: Path, prefix: str) -> Path:
    """Rename checkpoint `path` to `<prefix><name>` (a free name: `.2`, `.3` after an earlier
    one), out of resume's and pruning's way, kept for a look. Rank 0 renames; every rank
    returns the name rank 0 would choose before renaming."""
    aside, n = path.with_name(prefix + path.name), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{prefix}{path.name}.{n}")
    if current_rank() == 0:
        path.rename(aside)
    return aside


def set_aside_all(passed: list[tuple[Path, Problem]]) -> None:
    """Rename each checkpoint an `auto` resume passed by (or a save found damaged) out of the
    way with its prefix, one warning line each naming it and why."""
    for path, problem in passed:
        aside = set_aside(path, problem.prefix)
        if current_rank() == 0:
            log.warning("Checkpoint %s set aside as %s: %s", path, aside.name, problem)


# ---- Publishing and pruning


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable where the file system allows it (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_stale_temporaries(checkpoint_dir: Path) -> None:
    """Rank 0: delete the `.tmp-step_N` folders a crashed or failed save left (never resumed
    from); any other name, a user's `.tmp-notes` among them, is not a save's to delete."""
    if current_rank() != 0 or not checkpoint_dir.is_dir():
        return
    for stale in checkpoint_dir.glob(f"{TMP_PREFIX}step_*"):
        if step_of(stale.name.removeprefix(TMP_PREFIX).removesuffix(".replaced")) is not None:
            shutil.rmtree(stale, ignore_errors=True)


def verified_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """The complete checkpoints that are sound by the checks that read no tensors and whose
    every file has a recorded checksum, oldest first: keep-last counts and prunes these only."""
    return [p for p in complete_checkpoints(checkpoint_dir) if inspect_checkpoint(p) is None]


def prune_plan(checkpoints: list[Path], keep_last: int | None, newest: Path) -> list[Path]:
    """Checkpoints to delete so that `keep_last` remain; `newest` (just published) is never one.
    The caller passes verified checkpoints only (verified_checkpoints): an unverified one must
    never push a verified one out."""
    if not keep_last:
        return []
    others = [p for p in checkpoints if p != newest]
    surplus = len(others) + 1 - keep_last
    return others[:surplus] if surplus > 0 else []


def publish(
    tmp: Path, final: Path, marker: dict[str, Any], keep_last: int | None, started: float
) -> None:
    """Rank 0, once every rank's files are on disk and summed (their sums in `marker`): write
    the marker, rename `tmp` to `final` in one atomic rename, then prune to `keep_last`."""
    marker = {**marker, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_whole(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True, default=str))
    replaced = None
    incomplete = checkpoint_problem(final) if final.exists() else None
    if incomplete:  # damage: kept, named
        set_aside_all([(final, Problem(INCOMPLETE, incomplete))])
    if final.exists():  # the same step saved again (e.g. a rerun from older state)
        replaced = final.with_name(f"{TMP_PREFIX}{final.name}.replaced")
        final.rename(replaced)
    tmp.rename(final)
    fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    mb, seconds = dir_bytes(final) / 2**20, time.perf_counter() - started
    log.info("Checkpoint step %d saved to %s (%.1f MB, %.2f s)", marker["step"], final, mb, seconds)
    # The checkpoint just published is intact (its files were just summed), so pruning the
    # others never removes the last intact one.
    for old in prune_plan(verified_checkpoints(final.parent), keep_last, final):
        shutil.rmtree(old, ignore_errors=True)
        log.info("Removed old checkpoint %s (keep_last=%d)", old, keep_last)
