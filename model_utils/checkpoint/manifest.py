"""A checkpoint directory on disk: names, the marker, completeness, integrity, housekeeping.

Pure filesystem (safe before any process group exists): which directories are published
checkpoints, whether one is complete and intact (every file's size and sha256 recorded in the
marker), which one a resume would start from, and the file operations that publish and prune.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from model_utils.checkpoint.errors import ResumeRefused, all_damaged_message
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
from model_utils.checkpoint.ranks import current_rank
from model_utils.errors import first_line

DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed its checks, renamed by an `auto` resume
# A checkpoint without checksums for every file (saved before they were recorded, or the table
# removed), newer than the one an `auto` resume starts from: kept, out of resume and pruning.
UNVERIFIED_PREFIX = "unverified-"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger(__name__)


def resolve_checkpoint(
    resume_from_checkpoint: str | None, checkpoint_dir: str | Path
) -> Path | None:
    """`--resume_from_checkpoint`: None -> None; 'auto' -> newest complete checkpoint in
    checkpoint_dir or None (a fresh start); a PATH -> that path, which must be complete."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "auto":
        return latest_checkpoint(checkpoint_dir)
    problem = checkpoint_problem(resume_from_checkpoint)
    if problem:
        raise ValueError(f"--resume_from_checkpoint: {problem}")
    return Path(resume_from_checkpoint)


def check_resume_arg(resume_from_checkpoint: str | None, checkpoint_dir: str | Path) -> None:
    """Raise ValueError (one line) for a resume flag that cannot work; touches no file."""
    resolve_checkpoint(resume_from_checkpoint, checkpoint_dir)


def read_marker(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text())


# --------------------------------------------------------------------------------------------
# Integrity: every file's size and checksum in the marker, checked before a resume

SUM_ALGORITHM = "sha256"  # ~1.5 GB/s per core with SHA extensions; each rank sums its own files


def own_files(directory: Path) -> list[Path]:
    """The files this rank wrote into a DCP save: its shards, which DCP's FileSystemWriter names
    `__<rank>_<n>.distcp`, and on rank 0 the `.metadata`."""
    files = sorted(Path(directory).glob(f"__{current_rank()}_*.distcp"))
    return files + [Path(directory) / DCP_METADATA] if current_rank() == 0 else files


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
    an entry without its checksum, a size that is not a number) proves nothing, and
    unverified_reason names it."""
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


def needed_files(path: Path) -> list[str]:
    """Every file a load of checkpoint `path` reads: the .metadata, the shards it names, and
    any other shard in the folder. Metadata that cannot be read names none beyond itself."""
    names = {p.name for p in path.glob("*.distcp")}
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data or {}
        names |= {str(info.relative_path) for info in storage.values()}
    except Exception:
        pass
    return [DCP_METADATA, *sorted(names)]


def checkpoint_damage(path: str | Path) -> str | None:
    """Why a published checkpoint cannot be loaded, found without reading its tensors (one
    line naming the file), or None: marker and .metadata readable, every file a load reads
    present, and every file with a well-formed entry in the marker at its saved size. Whether
    the table proves the bytes is unverified_reason's question, not damage."""
    problem = checkpoint_problem(path)
    if problem:
        return problem
    path = Path(path)
    try:
        marker = read_marker(path)
        int(marker["step"])
    except Exception as exc:
        return f"{path / MARKER} is not a valid checkpoint marker ({first_line(exc)})"
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        return f"{path / DCP_METADATA} cannot be read ({first_line(exc)})"
    files = recorded_sums(marker)
    for name in needed_files(path):
        if name not in files and not (path / name).is_file():
            return f"{path / name} is missing"
    for name, saved in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != saved["bytes"]:
            return (
                f"{file} has {file.stat().st_size} bytes, {saved['bytes']} were saved "
                "(truncated or overwritten)"
            )
    return None


def content_damage(path: str | Path, files: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first of `files` (name -> saved sums) whose content no longer matches its checksum,
    or that cannot be read (gone since the cheap checks, an I/O error): a line, not an
    exception, because the ranks split the files and one rank raising would leave the others
    waiting in the gather of everyone's verdict. Entries without a well-formed checksum are
    not checked here (they prove nothing: unverified_reason names them)."""
    for name, saved in files.items():
        if _entry_problem(saved) is not None:
            continue
        try:
            now = file_sums([Path(path) / name])[name]
        except OSError as exc:
            return f"{Path(path) / name} cannot be read ({first_line(exc)})"
        if now[SUM_ALGORITHM] != saved[SUM_ALGORITHM]:
            return (
                f"{Path(path) / name} does not match its {SUM_ALGORITHM} (changed since the save)"
            )
    return None


def unverified_reason(path: str | Path) -> str | None:
    """Why the bytes of a checkpoint are not proven (one line), or None: verified means every
    file a load reads has a well-formed recorded size and sha256 (which verify then matches).
    No table, an empty or malformed one, a file without its entry, an entry without its
    checksum: all the same, unverified. Such a checkpoint could be corrupted without a sign,
    so it is never trusted unnamed (an `auto` resume and the converter pass it by) and never
    takes a verified one's place in keep-last."""
    path = Path(path)
    try:
        files = read_marker(path).get("files") or {}
    except (OSError, ValueError):
        return f"{path / MARKER} cannot be read"
    if not isinstance(files, dict) or not files:
        return f"{path / MARKER} records no checksums"
    for name in needed_files(path):
        if name not in files:
            return f"{path / MARKER} records no checksum for {name}"
        problem = _entry_problem(files[name])
        if problem:
            return f"{path / MARKER} records {problem} for {name}"
    return None


def verified_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """The complete checkpoints that are sound by the checks that read no tensors and whose
    every file has a recorded checksum, oldest first: keep-last counts and prunes these only."""
    return [
        p
        for p in complete_checkpoints(checkpoint_dir)
        if checkpoint_damage(p) is None and unverified_reason(p) is None
    ]


def verdict(path: Path, damage: str | None) -> tuple[str, str] | None:
    """(prefix it is set aside under, why) for a checkpoint an `auto` resume must pass by, or
    None for a sound, verified one. `damage`: checkpoint_damage's (or verify's) line."""
    if damage is not None:
        return DAMAGED_PREFIX, damage
    unverified = unverified_reason(path)
    return None if unverified is None else (UNVERIFIED_PREFIX, unverified)


def no_sound_checkpoint(checkpoint_dir: str | Path, passed: list[tuple[Path, str, str]]) -> str:
    """The refusal when an `auto` resume found checkpoints but none sound and verified."""
    unverified = [(path, why) for path, prefix, why in passed if prefix == UNVERIFIED_PREFIX]
    if not unverified:
        return all_damaged_message(checkpoint_dir, passed[0][2])
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


def set_aside_all(passed: list[tuple[Path, str, str]], then: str) -> None:
    """Rename each checkpoint an `auto` resume passed by (or a save found damaged) out of the
    way with its prefix, one warning line each naming it and why; then `then`, if any."""
    for path, prefix, why in passed:
        aside = set_aside(path, prefix)
        if current_rank() == 0:
            log.warning("Checkpoint %s set aside as %s: %s", path, aside.name, why)
    if passed and then and current_rank() == 0:
        log.warning("%s%s", then[0].upper(), then[1:])


def resume_candidate(resume_from_checkpoint: str | None, checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint a resume would start from, by the checks that read no tensors (before any
    process group; the checksums are verified by Checkpointer.resolve_intact): a PATH must pass
    them (else ResumeRefused naming the file); 'auto' passes damaged and unverified ones by
    (None: a fresh start, where there are none at all)."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint != "auto":
        path = resolve_checkpoint(resume_from_checkpoint, checkpoint_dir)
        damage = checkpoint_damage(path)
        if damage:
            raise ResumeRefused(f"--resume_from_checkpoint {path} is damaged: {damage}")
        return path
    passed = []
    for path in reversed(step_dirs(checkpoint_dir)):
        found = verdict(path, checkpoint_damage(path))
        if found is None:
            return path
        passed.append((path, *found))
    if passed:
        raise ResumeRefused(no_sound_checkpoint(checkpoint_dir, passed))
    return None


# --------------------------------------------------------------------------------------------
# Publishing and pruning


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write then rename, so a reader never sees half a marker."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def stale_temporaries(checkpoint_dir: Path, keep: Path | None = None) -> list[Path]:
    if not checkpoint_dir.is_dir():
        return []
    return [p for p in checkpoint_dir.iterdir() if p.name.startswith(TMP_PREFIX) and p != keep]


def prune_plan(checkpoints: list[Path], keep_last: int | None, newest: Path) -> list[Path]:
    """Checkpoints to delete so that `keep_last` remain; `newest` (just published) is never one.
    The caller passes verified checkpoints only (verified_checkpoints): an unverified one must
    never push a verified one out."""
    if not keep_last:
        return []
    others = [p for p in checkpoints if p != newest]
    surplus = len(others) + 1 - keep_last
    return others[:surplus] if surplus > 0 else []
