"""Write problems found before training, not at the first save: a location that cannot be
written (a file in the way, read-only, quota, root squash) or cannot hold one checkpoint is a
one-line refusal (exit 2); room for fewer checkpoints than the run keeps is a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
from pathlib import Path

from model_utils.config.run_config import Config
from model_utils.errors import Refusal, refuse, unwritable
from model_utils.parallel import distributed


class WriteProblem(Refusal, RuntimeError):
    """An output location cannot be written, or cannot hold one checkpoint: one line, exit 2."""


def output_locations(config: Config) -> dict[str, Path]:
    """Where the run writes: flag -> directory."""
    out = {
        "--output_dir": Path(config.run.output_dir),
        "--checkpoint_dir": Path(config.checkpoint.checkpoint_dir),
    }
    if config.checkpoint.export_hf:
        out["--export_hf"] = Path(config.checkpoint.export_hf)
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


def _loops(link: Path) -> bool:
    try:
        link.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def location_problem(flag: str, path: Path) -> str | None:
    """Why `path` cannot become a writable directory, found without creating anything: a file
    in the way, or a nearest existing folder that is read-only or not writable by this user."""
    if path.exists() and not path.is_dir():
        return f"{flag} {path} is a file, not a directory: choose another {flag}"
    dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if dangling:  # mkdir would say only "File exists"
        target, head = os.readlink(dangling), f"{flag} {path} cannot be created: {dangling} is a"
        if _loops(dangling):
            return f"{head} link that loops (to {target}): choose another {flag}"
        return f"{head} link to {target}, which does not exist; create it or choose another {flag}"
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{flag} {path} cannot be created: {existing} is a file; choose another {flag}"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else "is not writable"
        return f"{flag} {path} cannot be written: {existing} {why}; choose another {flag}"
    return None


def check_locations(locations: dict[str, Path], dataset: str = "", probe: bool = False) -> None:
    """WriteProblem (one line) for the first location that cannot be written, or that lies in
    the local `dataset` folder: its every file is read as text (a resume would read the run's
    own metrics as data, and refuse). Reads only, unless `probe` (--validate_only, before the
    launcher makes any folder): then each is written as the run will (probe_write)."""
    data = Path(dataset).expanduser().resolve() if dataset else None
    for flag, path in locations.items():
        if data and data.is_dir() and path.resolve().is_relative_to(data):
            inside = f"{flag} {path} is inside --dataset {dataset}, read whole as text"
            refuse(f"{inside}: choose another {flag}", WriteProblem)
        problem = location_problem(flag, path)
        refuse(problem or (probe_write(flag, path) if probe else None), WriteProblem)


def probe_write(flag: str, path: Path) -> str | None:
    """Create `path` and write, sync and delete a small file in it: what the run will do, so
    what access() cannot tell (quotas, NFS root squash, ACLs) shows now. None if it worked.
    Leaves nothing behind (the folders are made when needed); for one process only: see
    :func:`check_outputs` for ranks that share a node."""
    created = missing_folders(path)
    try:
        return _write_probe(flag, path)
    finally:
        remove_folders(created)


def missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_folders(folders: list[Path]) -> None:
    """Remove the folders a probe created, deepest first (so their parents empty in turn). One
    already gone (another rank of the node removed it) or holding something is left alone:
    rmdir never removes a folder with anything in it."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _write_probe(flag: str, path: Path) -> str | None:
    probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        return unwritable(flag, path, exc)
    return None


# A checkpoint holds fp32 weights (4 bytes per parameter) and the optimizer's two moments:
# fp32 for AdamW, about a byte each for 8-bit/FP8 moments; the rest (schedule, data position,
# RNG) is small. With --master_weights optimizer the weights are bf16 (2 bytes) and AdamW keeps
# an fp32 master copy (4 more).
WEIGHT_BYTES_PER_PARAM = {"params": 4, "optimizer": 2 + 4}
MOMENT_BYTES_PER_PARAM = {"adamw": 8, "adamw8bit": 2, "adamw_fp8": 2}
EXPORT_BYTES_PER_PARAM = 4  # --export_hf writes fp32 safetensors


def checkpoint_bytes(num_params: int, optimizer: str = "adamw", masters: str = "params") -> int:
    weights = WEIGHT_BYTES_PER_PARAM[masters]
    return num_params * (weights + MOMENT_BYTES_PER_PARAM.get(optimizer, 8))


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


def check_space(config: Config, num_params: int, log: logging.Logger) -> None:
    """Before training: WriteProblem if a checkpoint (or the HF export) cannot fit once; a
    warning if keep_last + 1 checkpoints cannot."""
    # Checked even with --checkpoint_freq -1: a preemption signal still saves. keep_last 0 keeps
    # every checkpoint: warn below two.
    keep = config.checkpoint.keep_last + 1 if config.checkpoint.keep_last else 2
    size = checkpoint_bytes(num_params, config.optim.optimizer, config.optim.master_weights)
    needs = [("checkpoint", size, keep, Path(config.checkpoint.checkpoint_dir))]
    if config.checkpoint.export_hf:
        export = EXPORT_BYTES_PER_PARAM * num_params
        needs.append(("Hugging Face export", export, 1, Path(config.checkpoint.export_hf)))
    for what, need, keep, where in needs:
        free = shutil.disk_usage(_nearest_existing(where)).free
        verdict, line = space_verdict(free, need, keep, what, where)
        if verdict == "refuse":
            raise WriteProblem(line)
        if verdict == "warn":
            log.warning(line)


def check_outputs(
    config: Config, world: distributed.World, num_params: int, log: logging.Logger
) -> None:
    """Every rank writes a probe file where it will write its checkpoint shards (mounts can
    differ between nodes); rank 0 also in the run and export folders, and checks that a
    checkpoint (and the export) fits in the free space. WriteProblem on every rank if any
    rank found a problem.

    The ranks of a node probe the same new folders at the same moment, so the folders the
    probes create are removed only once every rank has probed (the agreement below is a
    collective: a rank removing them while another is about to write there would refuse a good
    run), and every rank waits for the others' removals before it goes on (a rank that found
    the folders made by its neighbour removes nothing, and would open the checkpoint folder
    as the neighbour's rmdir takes it away)."""
    problem = None
    created: list[Path] = []
    for flag, path in output_locations(config).items():
        if problem is None and (world.is_main or flag == "--checkpoint_dir"):
            created += [p for p in missing_folders(path) if p not in created]
            problem = _write_probe(flag, path)
    if problem is None and world.is_main:
        try:
            check_space(config, num_params, log)
        except WriteProblem as exc:
            problem = str(exc)
    first = distributed.first_problem(problem)
    remove_folders(sorted(created, key=lambda p: len(p.parts), reverse=True))
    distributed.barrier()  # no rank goes on while another still removes
    refuse(first, WriteProblem)
