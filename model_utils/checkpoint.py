"""Checkpoints: DCP save/load with atomic publish, keep-last-k, auto-resume; HF safetensors in/out.

Layout of a checkpoint directory::

    <checkpoint_dir>/step_00000100/        a published, complete checkpoint
        .metadata, __0_0.distcp, ...       torch.distributed.checkpoint (DCP) files, one per rank
        checkpoint.json                    the marker: step, world size, run and model config,
                                           and every file's size and sha256
    <checkpoint_dir>/.tmp-step_00000200/   being written (or left by a crash): never resumed from
    <checkpoint_dir>/damaged-step_00000300/  failed its checks at an `auto` resume: set aside

Why the temporary name: DCP writes one file per rank and then `.metadata`; a job killed in the
middle leaves a directory that looks like a checkpoint but is not one. Every rank writes into
`.tmp-step_N`; when the save has finished everywhere, rank 0 writes `checkpoint.json` and renames
the directory to `step_N` (one atomic rename). Only names `step_N` holding both `.metadata` and
`checkpoint.json` count as complete. Stale `.tmp-*` directories are removed before the next save.
Before the rename each rank sums the files it wrote and rank 0 records the sums in the marker; a
resume checks them (the ranks split the files) and refuses, or with `auto` skips, a checkpoint
whose bytes changed since (`Checkpointer.resolve_intact`).

What is saved (one DCP state dict of Stateful items, see `TrainState`):
    model      FSDP2 DTensor shards (get_model_state_dict): resharded by DCP on load
    optimizer  AdamW state keyed by parameter name (get_optimizer_state_dict): resharded too
               (torchao's 8-bit/FP8 states as its own tensor subclasses; a reshard that would
               cut one of their blocks is refused: low_bit_reshard_problem)
    scheduler  LR scheduler state_dict (identical on every rank)
    progress   step and the run's config as JSON
    data       per rank: `data.rank{r}`, this rank's data-stream position
    rng        per rank: `rng.rank{r}`, python/numpy/torch(/cuda) generator states

Per-rank items need per-rank keys: DCP de-duplicates non-tensor values written under the same key
by several ranks and keeps only one copy (torch/distributed/checkpoint/_dedup_save_plans.py), so
a shared key `data` would silently restore rank k's position on every rank. Each per-rank value is
packed into bytes so DCP stores it as one opaque object, whatever tensors it contains.

World-size changes: model and optimizer reshard. Per-rank positions cannot be mapped (rank r of 2
and rank r of 1 read different shards), so a resharded load skips `data` and `rng`, reseeds the
generators from (seed, step, rank), and calls `TrainState.on_data_reshard(step, saved_states)`
if given (saved_states[r] = what rank r saved; e.g. move the stream to a position derived from
them or from the step); without it the stream keeps its fresh position (the beginning of this
rank's new shard). Both cases log a warning.

Implementation changes: --model_impl hf and te_linear share Hugging Face parameter names; te
fuses each decoder layer (QKV in one weight, gate/up in fc1). A checkpoint of the other layout is
converted on load through te_llama's mapping table (`load_converted`): each decoder layer is
read whole into plain tensors (DCP assembles them from the saved shards), mapped, and each rank
copies its block into its DTensor shards, so no rank holds more than one layer. AdamW's moments
have their parameter's shape and go through the same table. TE's `_extra_state` (FP8 scaling
history) belongs to TE's module structure and is not converted: it starts fresh, as does the
extra state a te_linear run finds missing in a checkpoint of --model_impl hf.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from model_utils.arguments import first_line

log = logging.getLogger(__name__)

# 2: TE's FP8 scaling state as plain tensors (item fp8_scaling), no pickled _extra_state.
CHECKPOINT_FORMAT = 2
MARKER = "checkpoint.json"
DCP_METADATA = ".metadata"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed its checks, renamed by an `auto` resume
_NAME_RE = re.compile(r"^step_(\d+)$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# HF checkpoints written by old transformers versions carry RoPE buffers; they are recomputed.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# A state-dict transform for another parameter layout (e.g. TE's fused layers); it receives a
# partial state dict (one decoder layer's tensors, or the non-layer ones) and returns the mapped
# partial state dict. load_hf_weights takes HF -> model, export_hf/dcp_to_hf take model -> HF.
KeyMap = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Names and completeness (pure filesystem: safe to call before any process group exists)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step encoded in a published checkpoint's directory name, None for other names."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete checkpoint (one line), or None if it is one."""
    path = Path(path)
    if not path.exists():
        return f"checkpoint {path} does not exist"
    if not path.is_dir():
        return f"checkpoint {path} is not a directory"
    if path.name.startswith(TMP_PREFIX):
        return f"checkpoint {path} is an unfinished save (temporary name)"
    if not (path / DCP_METADATA).is_file():
        return f"checkpoint {path} has no {DCP_METADATA}: not a DCP checkpoint or not finished"
    if not (path / MARKER).is_file():
        return f"checkpoint {path} has no {MARKER}: the save never completed"
    return None


def is_complete(path: str | Path) -> bool:
    return checkpoint_problem(path) is None


def complete_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Published complete checkpoints in `checkpoint_dir`, oldest step first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


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
    files = sorted(Path(directory).glob(f"__{_rank()}_*.distcp"))
    return files + [Path(directory) / DCP_METADATA] if _rank() == 0 else files


def file_sums(files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """name -> {"bytes", "sha256"}: what the marker records for each file."""
    out = {}
    for path in files:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, SUM_ALGORITHM).hexdigest()
        out[path.name] = {"bytes": path.stat().st_size, SUM_ALGORITHM: digest}
    return out


def checkpoint_damage(path: str | Path) -> str | None:
    """Why a published checkpoint cannot be loaded, found without reading its tensors (one
    line naming the file), or None: marker and .metadata readable, every file the marker lists
    present with its saved size. Checkpoints from before checksums list no files."""
    problem = checkpoint_problem(path)
    if problem:
        return problem
    path = Path(path)
    try:
        marker = read_marker(path)
        files = marker.get("files") or {}
        int(marker["step"])
    except Exception as exc:
        return f"{path / MARKER} is not a valid checkpoint marker ({first_line(exc)})"
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        return f"{path / DCP_METADATA} cannot be read ({first_line(exc)})"
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
    """The first of `files` (name -> saved sums) whose content no longer matches its checksum."""
    for name, saved in files.items():
        now = file_sums([Path(path) / name])[name]
        if now[SUM_ALGORITHM] != saved.get(SUM_ALGORITHM, now[SUM_ALGORITHM]):
            return (
                f"{Path(path) / name} does not match its {SUM_ALGORITHM} (changed since the save)"
            )
    return None


def resume_candidate(resume_from_checkpoint: str | None, checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint a resume would start from, by the checks that read no tensors (before any
    process group; the checksums are verified by Checkpointer.resolve_intact): a PATH must pass
    them (else ResumeRefused naming the file); 'auto' skips damaged ones (None: fresh start)."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint != "auto":
        path = resolve_checkpoint(resume_from_checkpoint, checkpoint_dir)
        damage = checkpoint_damage(path)
        if damage:
            raise ResumeRefused(f"--resume_from_checkpoint {path} is damaged: {damage}")
        return path
    found = complete_checkpoints(checkpoint_dir)
    sound = [p for p in reversed(found) if checkpoint_damage(p) is None]
    if found and not sound:
        raise ResumeRefused(_all_damaged_message(checkpoint_dir, checkpoint_damage(found[-1])))
    return sound[0] if sound else None


def _all_damaged_message(checkpoint_dir: str | Path, newest_problem: str | None) -> str:
    return (
        f"every checkpoint in {checkpoint_dir} is damaged (newest: {newest_problem}): restore "
        "one from a copy, or pass --overwrite_output_dir without --resume_from_checkpoint to "
        "start afresh"
    )


# --------------------------------------------------------------------------------------------
# Which run a checkpoint belongs to (pure: run before any process group exists)

# A checkpoint resumes only a run with the same model shape and the same data stream: a model
# with other shapes may still load when the tensors happen to fit (fewer layers, other head
# counts), and a data position means nothing in another dataset, tokenizer or shuffle.
MODEL_FIELDS = (
    "hidden_width",
    "num_layers",
    "num_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
    "rms_norm_eps",
    "rope_scaling",
)
DATA_FIELDS = ("dataset", "dataset_config_name", "text_column", "tokenizer", "seed")
# The optimizer's state is stored in its own format (fp32 moments, or torchao's 8-bit / FP8
# blocks): a resume keeps the saved --optimizer. Checkpoints from before the flag are adamw's.
OPTIMIZER_FIELDS = ("optimizer",)
_SAVED_DEFAULTS = {"optimizer": "adamw"}
# Flags that name this launch rather than the run: never compared, never reported.
_LAUNCH_FIELDS = frozenset(
    {
        "resume_from_checkpoint",
        "output_dir",
        "checkpoint_dir",
        "validate_only",
        "overwrite_output_dir",
        "export_hf",
        "init_from_hf",
    }
)


class ResumeRefused(ValueError):
    """The checkpoint belongs to another run, is damaged, or would be overwritten: one line."""


def _same(saved: Any, current: Any, name: str) -> bool:
    """Equal as the checkpoint stored them (JSON), paths by where they point."""
    current = json.loads(json.dumps(current, default=str))
    if saved == current:
        return True
    if name in ("dataset", "tokenizer") and isinstance(saved, str) and isinstance(current, str):
        return os.path.exists(saved) and os.path.realpath(saved) == os.path.realpath(current)
    return False


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list, list]:
    """Flags that differ between a checkpoint's run and this one, as ("--name", saved, now):
    (refused: model shape and data stream; allowed: everything else, e.g. batch size, sequence
    length, logging, precision). Fields an older checkpoint did not record are not compared,
    except those with a known value before they existed (--optimizer: adamw)."""
    if saved:
        saved = {**_SAVED_DEFAULTS, **saved}
    refused, allowed = [], []
    for name in sorted(set(saved) & set(current) - _LAUNCH_FIELDS):
        if not _same(saved[name], current[name], name):
            change = (f"--{name}", saved[name], current[name])
            kept = MODEL_FIELDS + DATA_FIELDS + OPTIMIZER_FIELDS
            (refused if name in kept else allowed).append(change)
    return refused, allowed


def describe_changes(changes: Iterable[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{flag} {saved} -> {now}" for flag, saved, now in changes)


def check_resumable(path: str | Path, current: Mapping[str, Any]) -> list:
    """ResumeRefused (one line listing each difference and what to do) unless the checkpoint at
    `path` was saved by a run of the same model shape and data; returns the allowed changes."""
    saved = read_marker(path).get("run_config") or {}
    refused, allowed = config_changes(saved, current)
    if refused:
        raise ResumeRefused(
            f"checkpoint {path} belongs to another run: {describe_changes(refused)} (saved -> "
            "this run); resume with the saved values, or start a new run in another --output_dir"
        )
    return allowed


def check_fresh_start(checkpoint_dir: str | Path, overwrite: bool) -> None:
    """A run without --resume_from_checkpoint must not write over an earlier run's checkpoints
    (its saves would replace them step by step and its pruning delete the rest)."""
    found = complete_checkpoints(checkpoint_dir)
    if found and not overwrite:
        raise ResumeRefused(
            f"{checkpoint_dir} holds {len(found)} checkpoint(s) of an earlier run (newest: step "
            f"{step_of(found[-1])}): continue it with --resume_from_checkpoint auto, choose "
            "another --output_dir, or pass --overwrite_output_dir to delete them and start afresh"
        )


# --------------------------------------------------------------------------------------------
# Stateful items


def _pack(obj: Any) -> bytes:
    """Serialise to bytes so DCP stores `obj` as one opaque object (not traversed for tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def capture_rng() -> dict[str, Any]:
    """Every generator a training step may draw from on this rank."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def derived_seed(seed: int, step: int, rank: int) -> int:
    """Deterministic per-(run, step, rank) seed for a resharded resume."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**32)


def reseed_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state")


class CheckpointWriteError(RuntimeError):
    """A save failed (disk full, read-only, permissions, ...): one line saying why and what was
    kept. The temporary directory is removed; published checkpoints are never touched."""


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
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if free is not None and free < _NEARLY_FULL_BYTES:
        return f"no space left on the device ({free / 2**20:.1f} MiB free in {directory})"
    return first_line(chain[-1] if chain else exc)


class UntrustedCheckpointError(RuntimeError):
    """The installed Transformer Engine refuses to unpickle FP8 state in an old checkpoint."""


#: TE's opt-in for unpickling ``_extra_state`` (TE >= 2.18). Never set by this recipe.
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def untrusted_checkpoint_message(path: str | Path, te_version: str) -> str:
    """One line for a format-1 checkpoint whose pickled FP8 state this TE refuses to load."""
    return (
        f"checkpoint {path} stores Transformer Engine's delayed-scaling FP8 state as a Python "
        f"pickle (checkpoint format 1), which Transformer Engine {te_version} refuses to load "
        "because unpickling can run code; if you trust this checkpoint (e.g. your own run "
        f"wrote it), resume once with {TE_UNSAFE_PICKLE_ENV}=1 in the job's environment (the "
        "next checkpoint is saved without pickles), or start a fresh run"
    )


class _ModelItem:
    """The model's sharded parameters under clean FQNs (no FSDP/compile/AC wrapper prefixes).

    TE modules' ``_extra_state`` (their FP8 metadata, pickled by TE) is left out: the FP8
    scaling state travels as plain tensors in :class:`_Fp8ScalingItem`. ``legacy=True`` reads a
    format-1 checkpoint, which stored the pickles (as opaque bytes, because their size changes
    once FP8 has run and DCP loads tensors in place); TE then decides whether to unpickle them.
    """

    def __init__(
        self, model: nn.Module, legacy: bool = False, absent_extra_state: Iterable[str] = ()
    ) -> None:
        self.model = model
        self.legacy = legacy
        # Legacy only: extra-state keys this model has but the checkpoint lacks (a te_linear run
        # loading a checkpoint of --model_impl hf): their TE modules start fresh FP8 metadata.
        self.absent = frozenset(absent_extra_state)

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self.model)
        if not self.legacy:
            return {k: v for k, v in sd.items() if not _is_extra_state(k)}
        return {
            k: _pack(v) if _is_extra_state(k) else v for k, v in sd.items() if k not in self.absent
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = {k: _unpack(v) if _is_extra_state(k) else v for k, v in state_dict.items()}
        try:
            result = set_model_state_dict(self.model, sd, options=StateDictOptions(strict=False))
        except RuntimeError as exc:
            if TE_UNSAFE_PICKLE_ENV in str(exc):
                raise UntrustedCheckpointError(str(exc).splitlines()[-1]) from exc
            raise
        allowed = (
            self.absent if self.legacy else {k for k in result.missing_keys if _is_extra_state(k)}
        )
        wrong = sorted(set(result.missing_keys) - allowed) + list(result.unexpected_keys)
        if wrong:
            raise RuntimeError(f"model state dict mismatch on load: {wrong[:5]}")


_FP8 = "fp8_scaling."


class _Fp8ScalingItem:
    """TE's delayed-scaling FP8 state as plain tensors (te_llama.fp8_scaling_state): per module
    and direction the scales and amax history, and the recipe's identity as JSON bytes. Saving
    and loading it unpickles nothing, so no TE release refuses it.

    For a load, ``saved`` gives each entry's shape and dtype from the checkpoint's metadata (a
    fresh model has no FP8 state to load into before its first FP8 forward); the loaded tensors
    wait in ``loaded`` until the Checkpointer hands them to the TE modules with the run's recipe.
    """

    def __init__(self, model: nn.Module, saved: Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.saved = saved
        self.loaded: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, Any]:
        if self.saved is None:
            import te_llama

            return te_llama.fp8_scaling_state(self.model)
        return {
            k: torch.empty(meta.size, dtype=meta.properties.dtype) for k, meta in self.saved.items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)


class _OptimizerItem:
    """Optimizer state keyed by parameter FQN, so it reshards like the model."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class _PerRankSave:
    """This rank's value of a per-rank item, packed, under key `rank{r}` (only this rank's key:
    the other ranks write theirs)."""

    def __init__(self, get: Callable[[], Any], rank: int) -> None:
        self.get, self.rank = get, rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": _pack(self.get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("_PerRankSave is for saving only")


class _PerRankLoad:
    """Reads the values saved by ranks `ranks` into `self.values` (rank -> unpacked value).

    Ranks may ask for different keys: DCP's default load planner plans every rank locally and
    runs the same collectives whatever the keys (default_planner.create_default_global_load_plan
    is the identity), so a same-world-size load reads only this rank's entry.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = list(ranks)
        self.values: dict[int, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{r}": b"" for r in self.ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = {r: _unpack(state_dict[f"rank{r}"]) for r in self.ranks}


class _ProgressItem:
    def __init__(self, train_state: TrainState) -> None:
        self.train_state = train_state

    def state_dict(self) -> dict[str, Any]:
        config = json.dumps(self.train_state.config, sort_keys=True, default=str)
        return {"step": self.train_state.step, "config": config}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_state.step = int(state_dict["step"])
        self.train_state.saved_config = json.loads(state_dict["config"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class TrainState:
    """Everything a resumed run needs. `step` is the number of optimizer steps done.

    data: any object with state_dict()/load_state_dict() holding THIS rank's stream position.
    config: the run's flags (json-able; non-json values are stored as str).
    on_data_reshard(step, saved_states): called instead of restoring the data position when the
    checkpoint was written by a different number of ranks; saved_states[r] is what rank r saved.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    data: Any | None = None
    config: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    on_data_reshard: Callable[[int, list[Any]], None] | None = None
    saved_config: dict[str, Any] | None = None
    # The TE recipe the model runs (None: no TE FP8); saved FP8 scaling state is restored into
    # the TE modules only when it is a delayed-scaling recipe, the one kind that keeps state.
    fp8_recipe: Any = None

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0) or 0)

    def model_config(self) -> dict[str, Any] | None:
        config = getattr(self.model, "config", None)
        return config.to_dict() if hasattr(config, "to_dict") else None

    def per_rank_getters(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
        items = {"rng": (capture_rng, restore_rng)}
        if self.data is not None:
            items["data"] = (self.data.state_dict, self.data.load_state_dict)
        return items

    def items(self, per_rank: Mapping[str, _PerRankLoad] | None = None) -> dict[str, Any]:
        """The DCP state dict: for a save (`per_rank=None`) this rank's per-rank values; for a
        load, the given per-rank load targets."""
        out: dict[str, Any] = {"model": _ModelItem(self.model), "progress": _ProgressItem(self)}
        fp8 = _Fp8ScalingItem(self.model)
        if per_rank is None and fp8.state_dict():
            out["fp8_scaling"] = fp8
        if self.optimizer is not None:
            out["optimizer"] = _OptimizerItem(self.model, self.optimizer)
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        if per_rank is None:
            rank = _rank()
            for name, (get, _put) in self.per_rank_getters().items():
                out[name] = _PerRankSave(get, rank)
        else:
            out.update(per_rank)
        return out


@dataclass(frozen=True)
class LoadResult:
    path: Path
    step: int
    saved_world_size: int
    resharded: bool
    saved_config: dict[str, Any]
    # The saved parameter layout when it differed from the model's and was converted, else None.
    converted_from: str | None = None


# --------------------------------------------------------------------------------------------
# Checkpointer


def _fsync_dir(path: Path) -> None:
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


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write then rename, so a reader never sees half a marker."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def stale_temporaries(checkpoint_dir: Path, keep: Path | None = None) -> list[Path]:
    if not checkpoint_dir.is_dir():
        return []
    return [p for p in checkpoint_dir.iterdir() if p.name.startswith(TMP_PREFIX) and p != keep]


def prune_plan(checkpoints: list[Path], keep_last: int | None, newest: Path) -> list[Path]:
    """Checkpoints to delete so that `keep_last` remain; `newest` (just published) is never one."""
    if not keep_last:
        return []
    others = [p for p in checkpoints if p != newest]
    surplus = len(others) + 1 - keep_last
    return others[:surplus] if surplus > 0 else []


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    marker: dict[str, Any]
    future: Future | None
    started: float
    published: bool = False
    error: BaseException | None = None
    sealed: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    """Saves and loads `TrainState`s under `checkpoint_dir`; every rank constructs one.

    keep_last: number of published checkpoints kept (None or 0: all). Pruning happens only after
    a new checkpoint is published. async_save: `dcp.async_save` stages the state to CPU memory and
    writes in a background thread on a dedicated gloo group (training collectives are not
    interleaved with checkpoint ones); the checkpoint is published as soon as every rank has
    written and summed its files (in that thread), and `save`, `wait` and `close` wait for it. A
    failed save raises on every rank from `wait`; the previous checkpoints are untouched.
    """

    def __init__(
        self, checkpoint_dir: str | Path, keep_last: int | None = None, async_save: bool = False
    ) -> None:
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep_last = keep_last or None
        self.async_save = async_save
        self._pending: _Pending | None = None
        self._last_saved_step: int | None = None
        self._publish_lock = threading.Lock()  # rank 0: done-callback thread vs wait()
        self._async_group = None
        if async_save and dist.is_initialized():
            # A second group so the background thread's collectives never interleave with the
            # training loop's on the default group (and async save needs a CPU backend).
            self._async_group = dist.new_group(backend="gloo")
        if _rank() == 0:
            for stale in stale_temporaries(self.checkpoint_dir):
                shutil.rmtree(stale, ignore_errors=True)

    def remove_all(self) -> None:
        """--overwrite_output_dir: delete an earlier run's published checkpoints before this run
        saves any (all ranks call; rank 0 deletes). Without it, the old run's newer steps would
        outlive pruning and a later `auto` resume would pick them."""
        if _rank() == 0:
            old = complete_checkpoints(self.checkpoint_dir)
            for path in old:
                shutil.rmtree(path)
            if old:
                log.info(
                    "Deleted %d checkpoint(s) of an earlier run in %s (--overwrite_output_dir)",
                    len(old),
                    self.checkpoint_dir,
                )
        _barrier()

    # -- discovery
    def latest(self) -> Path | None:
        """Newest complete checkpoint in checkpoint_dir, None if there is none."""
        return latest_checkpoint(self.checkpoint_dir)

    def verify(self, path: str | Path) -> str | None:
        """Why checkpoint `path` is damaged, or None if intact (all ranks call): the cheap checks,
        then every file's checksum, the files split over the ranks so each is read once."""
        problem = checkpoint_damage(path)
        if problem is None:
            files = sorted((read_marker(path).get("files") or {}).items())
            problem = content_damage(path, dict(files[_rank() :: _world_size()]))
        return next((p for p in _all_gather_object(problem) if p), None)

    def resolve_intact(self, resume_from_checkpoint: str | None) -> Path | None:
        """--resume_from_checkpoint, verified (all ranks call): None/'' -> None; PATH -> PATH if
        intact, else ResumeRefused naming the damaged file; 'auto' -> the newest intact
        checkpoint, with a warning for each newer damaged one it skips (None: fresh start)."""
        if not resume_from_checkpoint:
            return None
        if resume_from_checkpoint != "auto":
            path = resolve_checkpoint(resume_from_checkpoint, self.checkpoint_dir)
            problem = self.verify(path)
            if problem:
                raise ResumeRefused(f"--resume_from_checkpoint {path} is damaged: {problem}")
            return path
        found = _all_gather_object(complete_checkpoints(self.checkpoint_dir))[0]  # rank 0's
        first_problem = None
        for path in reversed(found):
            problem = self.verify(path)
            if problem is None:
                if first_problem:
                    log.warning("Resuming from %s, the newest intact checkpoint", path)
                return path
            first_problem = first_problem or problem
            aside = path.with_name(DAMAGED_PREFIX + path.name)
            log.warning("Checkpoint %s is damaged, set aside as %s: %s", path, aside.name, problem)
            if _rank() == 0:  # out of resume and pruning's way, kept for a look (delete it)
                path.rename(aside)
        if found:
            raise ResumeRefused(_all_damaged_message(self.checkpoint_dir, first_problem))
        return None

    def resolve(self, resume_from_checkpoint: str | None) -> Path | None:
        """None/'' -> None; 'auto' -> latest() (None: fresh start); PATH -> PATH if complete,
        else ValueError saying why."""
        return resolve_checkpoint(resume_from_checkpoint, self.checkpoint_dir)

    # -- save
    def save(self, step: int, state: TrainState, block: bool = False) -> Path:
        """Write `state` as checkpoint `step` (all ranks call). Returns the published path (for an
        async save, the path it will have). block=True waits for an async save to publish."""
        self.wait()
        final = self.checkpoint_dir / checkpoint_name(step)
        if self._last_saved_step == step and is_complete(final):
            return final  # e.g. a preemption save right after the periodic one
        self._last_saved_step = step
        tmp = self.checkpoint_dir / (TMP_PREFIX + final.name)
        if _rank() == 0:
            for stale in stale_temporaries(self.checkpoint_dir):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        _barrier()
        state.step = step
        marker = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "world_size": _world_size(),
            "items": sorted(
                ["model", "progress", *state.per_rank_getters()]
                + [k for k in ("optimizer", "scheduler") if getattr(state, k) is not None]
            ),
            "run_config": state.config,
            "model_config": state.model_config(),
            "torch": torch.__version__,
        }
        items = state.items()
        marker["items"] = sorted(set(marker["items"]) | ({"fp8_scaling"} & set(items)))
        pending = _Pending(step, tmp, final, marker, None, time.perf_counter())
        self._pending = pending
        if self.async_save:
            pending.future = dcp.async_save(
                items, checkpoint_id=str(tmp), process_group=self._async_group
            )
            # Each rank seals in DCP's background thread once its write is done; rank 0 then
            # publishes at once, so a job killed before the next save still keeps this one.
            pending.future.add_done_callback(
                lambda fut: self._seal(pending, fut.exception(), self._async_group)
            )
            if block:
                self.wait()
        else:
            try:
                dcp.save(items, checkpoint_id=str(tmp))
                failure = None
            except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
                failure = exc
            self._seal(pending, failure, None)
            self.wait()
        return final

    def _seal(self, pending: _Pending, failure: BaseException | None, group: Any) -> None:
        """Every rank, once its part of the save is written: checksum the files it wrote, gather
        every rank's sums (a collective on `group`), and rank 0 publishes with them in the
        marker. Never raises: the outcome goes to `pending.error`, raised by wait() on every
        rank."""
        try:
            if failure is not None:
                raise failure
            report: dict[str, Any] = {"files": file_sums(own_files(pending.tmp))}
        except (Exception, CheckpointException) as exc:
            report = {"error": write_error_reason(exc, self.checkpoint_dir)}
        try:
            reports = _all_gather_object(report, group)
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                pending.error = CheckpointWriteError(errors[0])
            elif _rank() == 0:
                sums = {name: sum_ for r in reports for name, sum_ in r["files"].items()}
                self._publish(pending, sums)
        except Exception as exc:  # e.g. the marker or the rename failed on rank 0
            pending.error = CheckpointWriteError(write_error_reason(exc, self.checkpoint_dir))
        finally:
            pending.sealed.set()

    def _publish(self, pending: _Pending, sums: dict[str, dict[str, Any]]) -> None:
        """Rank 0: marker (with every file's size and checksum), atomic rename, prune. Only
        called once every rank's files are on disk and summed."""
        with self._publish_lock:
            if pending.published:
                return
            pending.published = True
            pending.marker["files"] = dict(sorted(sums.items()))
            self._publish_locked(pending)

    def _publish_locked(self, pending: _Pending) -> None:
        marker = {**pending.marker, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        _write_json(pending.tmp / MARKER, marker)
        replaced = None
        if pending.final.exists():  # the same step saved again (e.g. a rerun from older state)
            replaced = pending.final.with_name(f"{TMP_PREFIX}{pending.final.name}.replaced")
            pending.final.rename(replaced)
        pending.tmp.rename(pending.final)
        _fsync_dir(pending.final.parent)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        seconds = time.perf_counter() - pending.started
        log.info(
            "Checkpoint step %d saved to %s (%.1f MB, %.2f s)",
            pending.step,
            pending.final,
            _dir_bytes(pending.final) / 2**20,
            seconds,
        )
        # The checkpoint just published is intact (its files were just summed), so pruning the
        # others never removes the last intact one.
        for old in prune_plan(
            complete_checkpoints(self.checkpoint_dir), self.keep_last, pending.final
        ):
            shutil.rmtree(old, ignore_errors=True)
            log.info("Removed old checkpoint %s (keep_last=%d)", old, self.keep_last)

    def wait(self) -> None:
        """Finish the pending save (all ranks call): wait until it is sealed (published on rank
        0), then raise its error on every rank if any rank had one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.exception()  # done; the outcome is reported by _seal
        pending.sealed.wait()
        if _any_rank(pending.error is not None):
            if _rank() == 0 and pending.tmp.exists():
                shutil.rmtree(pending.tmp, ignore_errors=True)  # the previous checkpoint stays
            reason = str(pending.error or "another rank failed (see rank 0's log)")
            latest = self.latest()
            kept = f"the newest checkpoint, {latest}, is kept" if latest else "none was saved yet"
            raise CheckpointWriteError(
                f"checkpoint step {pending.step} could not be written to {self.checkpoint_dir}: "
                f"{reason}; {kept}; free space or fix the location, then resume with "
                "--resume_from_checkpoint auto"
            ) from pending.error

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()

    # -- load
    def load(self, path: str | Path, state: TrainState) -> LoadResult:
        """Restore `state` from checkpoint `path` (all ranks call); `state.step` is updated.

        Same world size: everything is restored exactly. Different world size: model, optimizer,
        scheduler and step are restored (DCP reshards); RNGs are reseeded from (seed, step, rank);
        the data stream gets `state.on_data_reshard(step, saved_states)` with every saved rank's
        data state (index = saved rank), or keeps its fresh position if no hook is set.

        Another parameter layout (saved by --model_impl hf or te_linear, loaded by te, or the
        reverse): weights and AdamW moments are converted through te_llama's mapping table one
        decoder layer at a time (`load_converted`); step, LR schedule, data and RNG load as
        usual, and TE's FP8 metadata starts fresh. TE extra state that a same-layout checkpoint
        lacks (hf -> te_linear) starts fresh too.
        """
        problem = checkpoint_problem(path)
        if problem:
            raise ValueError(problem)
        path = Path(path)
        marker = read_marker(path)
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        saved_keys = metadata.state_dict_metadata
        model_keys = list(get_model_state_dict(state.model))
        saved_layout = param_layout(k[len(_MODEL) :] for k in saved_keys if k.startswith(_MODEL))
        convert = saved_layout != param_layout(model_keys)
        saved_world_size = int(marker["world_size"])
        resharded = saved_world_size != _world_size()
        getters = state.per_rank_getters()
        available = set(marker.get("items", getters))
        if set(getters) - available:
            log.warning("Checkpoint %s has no %s state", path, sorted(set(getters) - available))
        reads = {n: _ranks_to_read(n, resharded, saved_world_size) for n in getters}
        targets = {n: _PerRankLoad(r) for n, r in reads.items() if n in available and r}
        items = state.items(targets)
        saved_fp8 = {k[len(_FP8) :]: v for k, v in saved_keys.items() if k.startswith(_FP8)}
        if resharded and not convert and "optimizer" in items:
            problem = low_bit_reshard_problem(metadata, state.model, state.optimizer)
            problem = next((p for p in _all_gather_object(problem) if p), None)
            if problem:
                raise ResumeRefused(
                    f"checkpoint {path} was saved by {saved_world_size} ranks and cannot load "
                    f"on {_world_size()}: {problem}; resume on {saved_world_size} ranks, or on "
                    "a count whose shards hold whole blocks"
                )
        if convert:
            del items["model"]
            items.pop("optimizer", None)
        else:
            items["model"] = self._model_item(path, state, saved_keys, model_keys)
            if saved_fp8:
                items["fp8_scaling"] = _Fp8ScalingItem(state.model, saved_fp8)
        try:
            dcp.load(items, checkpoint_id=str(path))
        except UntrustedCheckpointError as exc:
            te = sys.modules.get("transformer_engine")
            version = getattr(te, "__version__", "this release")
            raise UntrustedCheckpointError(untrusted_checkpoint_message(path, version)) from exc
        if convert:
            saved_impl = (marker.get("run_config") or {}).get("model_impl", "?")
            load_converted(path, metadata, state, saved_layout, saved_impl)
        if "fp8_scaling" in items:
            _restore_fp8_scaling(path, state, items["fp8_scaling"].loaded)
        if resharded:
            self._after_reshard(state, saved_world_size, targets.get("data"))
        else:
            for name, target in targets.items():
                getters[name][1](target.values[_rank()])
        return LoadResult(
            path,
            state.step,
            saved_world_size,
            resharded,
            state.saved_config or {},
            converted_from=saved_layout if convert else None,
        )

    @staticmethod
    def _model_item(path: Path, state: TrainState, saved_keys, model_keys) -> _ModelItem:
        """The model's load target: format 2, or format 1 with TE's pickled extra state."""
        if not any(k.startswith(_MODEL) and _is_extra_state(k) for k in saved_keys):
            return _ModelItem(state.model)
        absent = [k for k in model_keys if _is_extra_state(k) and _MODEL + k not in saved_keys]
        if absent:
            log.info(
                "Checkpoint %s has no Transformer Engine extra state for %d modules (saved "
                "without TE modules): their FP8 metadata starts fresh",
                path,
                len(absent),
            )
        return _ModelItem(state.model, legacy=True, absent_extra_state=absent)

    @staticmethod
    def _after_reshard(state: TrainState, saved_world_size: int, data: _PerRankLoad | None) -> None:
        reseed_rng(derived_seed(state.seed, state.step, _rank()))
        if state.data is None or data is None:
            action = "data stream is left as is (nothing saved or nothing to restore)"
        elif state.on_data_reshard is not None:
            saved = [data.values[r] for r in range(saved_world_size)]
            state.on_data_reshard(state.step, saved)
            action = "data stream is repositioned by on_data_reshard"
        else:
            action = "data stream starts from the beginning of this rank's new shard"
        log.warning(
            "Checkpoint written by %d ranks, loaded on %d: model and optimizer resharded; "
            "per-rank data positions and RNG states do not map onto the new ranks, so the RNGs "
            "are reseeded from (seed, step=%d, rank) and the %s",
            saved_world_size,
            _world_size(),
            state.step,
            action,
        )


def _restore_fp8_scaling(path: Path, state: TrainState, tensors: dict[str, torch.Tensor]) -> None:
    """Hand saved delayed-scaling state to the TE modules, or say why it is not used."""
    import te_llama

    recipe = state.fp8_recipe
    saved = next(
        (te_llama.decode_recipe_identity(v) for k, v in tensors.items() if k.endswith("recipe")),
        {},
    )
    if recipe is None or not recipe.delayed():
        log.info(
            "Checkpoint %s holds FP8 delayed-scaling state (%s); this run uses %s, so it is not "
            "used",
            path,
            saved.get("class"),
            type(recipe).__name__ if recipe else "no TE FP8",
        )
        return
    restored = te_llama.load_fp8_scaling_state(state.model, tensors, recipe)
    now = te_llama.recipe_identity(recipe)
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    log.info(
        "FP8 scaling state of %d TE modules restored from %s%s",
        len(restored),
        path,
        f" (recipe changed since the save: {changed})" if changed else "",
    )


def _ranks_to_read(name: str, resharded: bool, saved_world_size: int) -> list[int]:
    """Own entry on a same-size load; on a resharded load every saved data entry (handed to the
    reshard hook) and no RNG entry (reseeded instead)."""
    if not resharded:
        return [_rank()]
    return list(range(saved_world_size)) if name == "data" else []


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (a world of one without a process group: [obj])."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (a collective on the default group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Cross-layout loads: a checkpoint of another parameter layout (hf/te_linear <-> te)

_MODEL = "model."
_OPT_STATE = "optimizer.state."
_OPT_GROUPS = "optimizer.param_groups."
# Per-group entries that name parameters (they follow the model's layout, not the checkpoint's).
_GROUP_PARAM_KEYS = ("params", "param_names")


def param_layout(names: Iterable[str]) -> str:
    """'te' if the parameter names are the TE TransformerLayer layout of --model_impl te (fused
    QKV and fc1), else 'hf': Hugging Face names, shared by --model_impl hf and te_linear (whose
    te.Linear keeps `weight`; only its `_extra_state` entries are extra)."""
    import te_llama

    segment = f".{te_llama.TE_LAYER_ATTR}."
    return "te" if any(segment in name for name in names) else "hf"


def layout_key_map(saved_layout: str, layout: str, config: Any) -> KeyMap:
    """Names and fused tensors of `saved_layout` -> `layout`, one decoder layer at a time, by
    te_llama's mapping table (the one --init_from_hf and --export_hf use)."""
    import te_llama

    functions = {
        ("hf", "te"): te_llama.hf_to_te_state_dict,
        ("te", "hf"): te_llama.te_to_hf_state_dict,
    }
    if (saved_layout, layout) not in functions:
        raise ValueError(f"no parameter mapping from layout {saved_layout!r} to {layout!r}")
    return layerwise_key_map(functions[(saved_layout, layout)], config)


def _tensor_entries(metadata: Any, prefix: str) -> dict[str, tuple[str, Any]]:
    """Saved tensors under `prefix` (TE extra state excluded): name -> (DCP key, metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key[len(prefix) :]: (key, md)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and not _is_extra_state(key)
    }


def _read_full_tensors(path: Path, entries: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Whole saved tensors on CPU (DCP assembles them from every saved shard). no_dist: each rank
    reads on its own, without collectives, so ranks need not request the same keys."""
    out = {n: torch.empty(md.size, dtype=md.properties.dtype) for n, (_, md) in entries.items()}
    if out:
        request = {key: out[n] for n, (key, _) in entries.items()}
        _load_local(request, path)
    return out


def _load_local(request: dict[str, Any], path: Path) -> None:
    """dcp.load in this process only (no_dist), without DCP's single-process warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, checkpoint_id=str(path), no_dist=True)


@torch.no_grad()
def _copy_converted(
    path: Path,
    saved: Mapping[str, tuple[str, Any]],
    key_map: KeyMap,
    targets: Mapping[str, torch.Tensor],
    what: str,
) -> int:
    """Read `saved` (name -> DCP key, metadata) one decoder layer at a time, convert it with
    `key_map`, and copy this rank's block of each converted tensor into `targets` (DTensor
    shards or plain tensors). Memory: one layer of full tensors. Returns the tensors copied;
    ValueError if the converted names or shapes do not match the targets."""
    aliases = _alias_groups(targets)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for group in layer_groups(saved):
        full = _read_full_tensors(path, {n: saved[n] for n in group})
        for name, tensor in key_map(full).items():
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"checkpoint {path}: {what} {name} converts to shape {tuple(tensor.shape)} "
                    f"but the model has {tuple(target.shape)}: does the model shape match?"
                )
            _local(target).copy_(tensor[_local_index(target)])
            loaded.add(name)
    _require_exact_match(
        f"checkpoint {path}: converted {what}", targets, loaded, aliases, unexpected
    )
    return len(loaded)


def _optimizer_fields(metadata: Any) -> dict[str, dict[str, tuple[str, Any]]]:
    """Saved optimizer state by field (exp_avg, exp_avg_sq, step, ...): {param FQN: entry}."""
    fields: dict[str, dict[str, tuple[str, Any]]] = {}
    for key, entry in _tensor_entries(metadata, _OPT_STATE).items():
        fqn, _, name = key.rpartition(".")
        fields.setdefault(name, {})[fqn] = entry
    return fields


def moment_conversion_problem(
    fields: Mapping[str, Mapping[str, tuple[str, Any]]],
    param_shapes: Mapping[str, tuple[int, ...]],
    target_fields: Iterable[str],
) -> str | None:
    """Why saved optimizer state cannot be converted through the parameter mapping, or None.

    Convertible: this optimizer keeps the same fields, every parameter has each of them, and
    each field is shaped like its parameter for every parameter (Adam's exp_avg/exp_avg_sq:
    they concatenate and split exactly like the weights) or is a scalar (Adam's step)."""
    if not fields:
        return "the checkpoint holds no optimizer state"
    if set(fields) != set(target_fields):
        return (
            f"saved optimizer fields {sorted(fields)} != this optimizer's {sorted(target_fields)}"
        )
    for field_name, per_param in fields.items():
        if set(per_param) != set(param_shapes):
            return f"optimizer state {field_name!r} is not kept for every parameter"
        shapes = [(tuple(md.size), param_shapes[fqn]) for fqn, (_, md) in per_param.items()]
        if not (all(s == p for s, p in shapes) or all(s == () for s, _ in shapes)):
            return f"optimizer state {field_name!r} is neither parameter-shaped nor a scalar"
    return None


# torchao/optim/adam.py `_AdamBase._new_buffer`: a state shard is quantized only when it holds at
# least this many values and a whole number of blocks; smaller ones stay plain fp32 tensors.
_TORCHAO_MIN_QUANTIZED = 4096


def _is_quantized_state(tensor: torch.Tensor) -> bool:
    """torchao's OptimState8bit / OptimStateFp8 (a wrapper subclass with a block size)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = _local(tensor)
    return is_traceable_wrapper_subclass(local) and hasattr(local, "block_size")


def low_bit_reshard_problem(metadata: Any, model: nn.Module, optimizer: Any) -> str | None:
    """Why this rank cannot load torchao's block-quantized optimizer state on this world size,
    or None (always None for optimizers without torchao's ``block_size``).

    A resharded DCP load cuts each saved shard where this rank's shard starts or ends, and
    writes into this rank's shard where a saved shard starts or ends. torchao's OptimState8bit
    and OptimStateFp8 can be cut only along dim 0 and only between blocks (their `aten.slice`
    in torchao/optim/subclass_8bit.py and subclass_fp8.py raises "Make sure start and end align
    with block boundary" otherwise), and a shard is quantized only when it holds >= 4096 values,
    a multiple of the block (`_new_buffer` in torchao/optim/adam.py). On the Llama presets every
    row is whole blocks (hidden and intermediate sizes are multiples of 256), so any world size
    works; a shape such as the tiny preset's 688-wide down_proj on 3 ranks does not."""
    block = getattr(optimizer, "block_size", None)
    if not isinstance(block, int):
        return None
    import math

    states = get_optimizer_state_dict(model, optimizer)["state"]  # creates the lazy state
    for field_name, per_param in _optimizer_fields(metadata).items():
        for fqn, (_, md) in per_param.items():
            target = states.get(fqn, {}).get(field_name)
            if target is None or len(md.size) == 0:
                continue
            shape = tuple(md.size)
            stride = math.prod(shape[1:])
            rows = _local_index(target)[0]
            t0, t1 = rows.start, rows.stop
            target_quantized = _is_quantized_state(target)
            for chunk in md.chunks:
                s0, s1 = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
                o0, o1 = max(s0, t0), min(s1, t1)
                if o0 >= o1:
                    continue
                numel = math.prod(chunk.sizes)
                saved_quantized = numel >= _TORCHAO_MIN_QUANTIZED and numel % block == 0
                cuts = []  # (first row of the quantized shard, row where it is cut)
                if saved_quantized and (o0, o1) != (s0, s1):
                    cuts += [(s0, o0), (s0, o1)]
                if target_quantized and (o0, o1) != (t0, t1):
                    cuts += [(t0, o0), (t0, o1)]
                bad = [row for start, row in cuts if (row - start) * stride % block]
                if bad:
                    return (
                        f"torchao keeps optimizer state {fqn} ({field_name}, shape {shape}) in "
                        f"blocks of {block} values and cuts it only between blocks "
                        "(aten.slice in torchao/optim/subclass_8bit.py, subclass_fp8.py), but "
                        f"the shard boundary at row {bad[0]} falls inside a block"
                    )
    return None


@torch.no_grad()
def _load_param_group_hyperparameters(path: Path, metadata: Any, optimizer: Any) -> bool:
    """Restore each saved param group's lr, initial_lr, betas, weight decay, ... exactly as a
    same-layout load would (so the LR schedule continues from the saved lr); the parameter lists
    keep this model's names. False (nothing restored) if the group counts differ. torchao's
    optimizers hold lr (and so initial_lr) as 0-d tensors: those are read as tensors and filled
    in place, so the group keeps the tensor its optimizer requires."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    saved_groups = {k[len(_OPT_GROUPS) :].split(".")[0] for k in saved if k.startswith(_OPT_GROUPS)}
    if len(saved_groups) != len(optimizer.param_groups):
        return False
    wanted = {
        f"{_OPT_GROUPS}{i}.{name}": (i, name)
        for i, group in enumerate(optimizer.param_groups)
        for name in group
        if name not in _GROUP_PARAM_KEYS and f"{_OPT_GROUPS}{i}.{name}" in saved
    }
    values: dict[str, Any] = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        if isinstance(md := saved[key], TensorStorageMetadata)
        else None
        for key in wanted
    }
    if values:
        _load_local(values, path)
    for key, (i, name) in wanted.items():
        group, value = optimizer.param_groups[i], values[key]
        if isinstance(group[name], torch.Tensor) and isinstance(value, torch.Tensor):
            group[name].copy_(value)
        else:
            group[name] = value.item() if isinstance(value, torch.Tensor) else value
    return True


@torch.no_grad()
def load_converted_optimizer(
    path: Path, metadata: Any, model: nn.Module, optimizer: Any, key_map: KeyMap
) -> str:
    """Convert the saved optimizer state to this model's layout; returns what happened (logged).

    Adam's moments have their parameter's shape, so the weights' mapping converts them
    (a fused QKV moment is the concatenation of the q, k and v moments, exactly as if the fused
    parameter had been trained); `step` is the same count for every parameter (the largest saved
    one is used). State that does not fit this scheme (another optimizer) restarts from zero:
    the weights and schedule still resume, only the moments are rebuilt by the next steps."""
    params = {n: tuple(md.size) for n, (_, md) in _tensor_entries(metadata, _MODEL).items()}
    fields = _optimizer_fields(metadata)
    osd = get_optimizer_state_dict(model, optimizer)  # creates AdamW's lazy state
    entries = list(osd["state"].values())
    problem = moment_conversion_problem(fields, params, entries[0] if entries else ())
    if problem is None:
        for field_name, per_param in fields.items():
            if all(len(md.size) == 0 for _, md in per_param.values()):
                saved_values = _read_full_tensors(path, per_param).values()
                largest = max(saved_values, key=lambda t: t.item())
                for entry in entries:
                    entry[field_name].copy_(largest)
                continue
            targets = {fqn: entry[field_name] for fqn, entry in osd["state"].items()}
            _copy_converted(path, per_param, key_map, targets, f"optimizer {field_name}")
        set_optimizer_state_dict(model, optimizer, osd)
        outcome = f"optimizer state ({', '.join(sorted(fields))}) converted"
        if any(_is_quantized_state(v) for entry in entries for v in entry.values()):
            outcome += " (torchao's blocks re-quantized in this layout: close, not bit for bit)"
    else:
        optimizer.state.clear()  # fresh moments and step: AdamW re-creates them at the next step
        outcome = f"optimizer moments restart from zero ({problem})"
    if not _load_param_group_hyperparameters(path, metadata, optimizer):
        outcome += "; param groups differ in number, so their lr/betas/decay are this run's"
    return outcome


@torch.no_grad()
def load_converted(
    path: Path, metadata: Any, state: TrainState, saved_layout: str, saved_impl: str = "?"
) -> None:
    """Load model weights and optimizer state saved in another parameter layout (all ranks).

    No rank ever holds more than one decoder layer in full: each layer's saved tensors are read
    whole (DCP assembles them from the saved shards, whatever the saved world size), converted
    by te_llama's table, and each rank copies its own block into its DTensor shards. TE's
    `_extra_state` (FP8 scaling history) is tied to TE's module structure and is not converted:
    FP8 metadata starts fresh, as after --init_from_hf."""
    targets = weight_tensors(get_model_state_dict(state.model))
    layout = param_layout(targets)
    config = getattr(state.model, "config", None)
    if config is None:
        raise ValueError(f"checkpoint {path}: converting layout {saved_layout!r} needs a config")
    key_map = layout_key_map(saved_layout, layout, config)
    count = _copy_converted(path, _tensor_entries(metadata, _MODEL), key_map, targets, "weight")
    outcome = "no optimizer"
    if state.optimizer is not None:
        outcome = load_converted_optimizer(path, metadata, state.model, state.optimizer, key_map)
    log.warning(
        "Checkpoint %s was saved by --model_impl %s (%s parameter layout); this model has the %s "
        "layout: %d weights converted through te_llama's mapping one decoder layer at a time; "
        "%s; Transformer Engine FP8 metadata starts fresh",
        path,
        saved_impl,
        saved_layout,
        layout,
        count,
        outcome,
    )


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors: in


def hf_weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file for a HF checkpoint (single file, or sharded with
    model.safetensors.index.json). ValueError with one line if `path` is neither."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        files = {path: None}
    elif (path / HF_INDEX).is_file():
        weight_map = json.loads((path / HF_INDEX).read_text()).get("weight_map", {})
        if not weight_map:
            raise ValueError(f"{path / HF_INDEX} has no weight_map")
        names_by_file: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            names_by_file.setdefault(path / fname, []).append(name)
        missing = [str(f) for f in names_by_file if not f.is_file()]
        if missing:
            raise ValueError(f"{path / HF_INDEX} lists missing shard(s): {', '.join(missing)}")
        return {name: f for f, names in names_by_file.items() for name in names}
    elif (path / HF_SINGLE).is_file():
        files = {path / HF_SINGLE: None}
    elif not path.exists():
        raise ValueError(f"--init_from_hf: {path} does not exist")
    else:
        raise ValueError(
            f"--init_from_hf: {path} has neither {HF_SINGLE} nor {HF_INDEX} "
            "(only safetensors checkpoints are supported)"
        )
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def check_hf_dir(path: str | Path) -> None:
    """Raise ValueError (one line) unless `path` is a loadable HF safetensors checkpoint."""
    try:
        hf_weight_files(path)
    except ValueError:
        raise
    except Exception as exc:  # a corrupt header, unreadable file, ...
        raise ValueError(f"--init_from_hf: cannot read {path}: {exc}") from exc


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by decoder layer index (non-layer names first, as one group), so a key map
    always sees a whole layer and memory stays bounded by one layer."""
    groups: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER_RE.search(name)
        groups.setdefault(int(match.group(1)) if match else -1, []).append(name)
    return [groups[k] for k in sorted(groups)]


def weight_tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The entries that are weights: tensors, minus FP8 bookkeeping (TE's `_extra_state`)."""
    return {
        k: v
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor) and not _is_extra_state(k)
    }


def _with_layer_index(name: str, index: int) -> str:
    return _LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), str(index)), name, count=1)


def layerwise_key_map(fn: Callable[[dict[str, torch.Tensor], Any], dict], config: Any) -> KeyMap:
    """Adapt a whole-model mapping `fn(state_dict, config)` that loops over
    `config.num_hidden_layers` (te_llama.hf_to_te_state_dict / te_to_hf_state_dict) to the
    one-layer-at-a-time KeyMap contract: layer i is renamed to layer 0, mapped with a one-layer
    config, and renamed back; the non-layer group is mapped with a zero-layer config."""
    import copy

    one_layer, no_layer = copy.copy(config), copy.copy(config)
    one_layer.num_hidden_layers, no_layer.num_hidden_layers = 1, 0

    def mapped(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layers = {int(m.group(1)) for m in map(_LAYER_RE.search, group) if m}
        if not layers:
            return fn(group, no_layer)
        if len(layers) > 1:
            raise ValueError(f"a key-map group spans layers {sorted(layers)}")
        (index,) = layers
        out = fn({_with_layer_index(k, 0): v for k, v in group.items()}, one_layer)
        return {_with_layer_index(k, index): v for k, v in out.items()}

    return mapped


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """Unwrap tensor subclasses (e.g. torchao's WeightWithDynamicFloat8CastTensor) to a plain
    tensor holding the high-precision values."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _alias_groups(targets: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> first name sharing its storage (tied lm_head/embed_tokens)."""
    first: dict[tuple[int, int], str] = {}
    out: dict[str, str] = {}
    for name, tensor in targets.items():
        local = _plain(_local(tensor))
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        out[name] = first.setdefault(key, name) if local.numel() else name
    return out


def _local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """This rank's block of the global tensor, as slices (all of it for a plain tensor)."""
    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _require_exact_match(
    source: str,
    targets: Mapping[str, Any],
    loaded: set[str],
    aliases: Mapping[str, str],
    unexpected: list[str],
) -> None:
    """Every model tensor was filled (a tied alias counts as its root) and nothing was left over."""
    roots = {aliases[n] for n in loaded}
    missing = sorted(n for n in targets if n not in loaded and aliases[n] not in roots)
    if missing or unexpected:

        def some(names: list[str]) -> str:
            return f"{names[:5]}{'...' if len(names) > 5 else ''}"

        raise ValueError(
            f"{source} does not match the model: missing {some(missing)}, "
            f"unexpected {some(unexpected)}"
        )


def _check_shape(name: str, got: Iterable[int], target: torch.Tensor) -> None:
    got = tuple(got)
    if got != tuple(target.shape):
        raise ValueError(
            f"HF tensor {name} has shape {got} but the model expects {tuple(target.shape)}: "
            "does the model shape (--hidden_width, --num_layers, --vocab_size, ...) match "
            "the checkpoint's config.json?"
        )


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of `full` into `target` (a DTensor shard or a plain tensor); every
    rank holds the same `full`, so no communication is needed (src_data_rank=None)."""
    if isinstance(target, DTensor):
        full = full.to(device=target.device)
        full = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
    _local(target).copy_(full)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, key_map: KeyMap | None = None) -> None:
    """Load a HF Llama safetensors checkpoint into a sharded (FSDP2) or plain model in place.

    Without a key map each rank reads only its own rows of each tensor (safetensors slices are
    lazy reads), so no rank ever holds the whole model, nor a whole tensor. With a key map (a
    different parameter layout, e.g. TE) one decoder layer is read in full at a time, mapped,
    and each rank keeps its shard. Raises ValueError on missing, unexpected or mis-shaped keys.
    """
    from safetensors import safe_open

    files = hf_weight_files(path)
    targets = weight_tensors(get_model_state_dict(model))
    aliases = _alias_groups(targets)
    loaded: set[str] = set()
    unexpected: list[str] = []
    handles: dict[Path, Any] = {}

    def handle(name: str) -> Any:
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f]

    names = [n for n in files if not n.endswith(_IGNORED_HF_SUFFIXES)]
    for group in layer_groups(names):
        if key_map is None:
            for name in group:
                if name not in targets:
                    unexpected.append(name)
                    continue
                target = targets[name]
                lazy = handle(name).get_slice(name)
                _check_shape(name, lazy.get_shape(), target)
                _local(target).copy_(lazy[_local_index(target)])
                loaded.add(name)
            continue
        mapped = key_map({name: handle(name).get_tensor(name) for name in group})
        for name, full in mapped.items():
            if name not in targets:
                unexpected.append(name)
                continue
            _check_shape(name, full.shape, targets[name])
            copy_full_into(targets[name], full)
            loaded.add(name)
    _require_exact_match(f"HF checkpoint {path}", targets, loaded, aliases, unexpected)
    log.info("Loaded %d tensors from Hugging Face checkpoint %s", len(loaded), path)


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors: out


class SafetensorsShardWriter:
    """Accumulates tensors and writes HF-style shards of at most `max_shard_bytes`:
    model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.out_dir.glob("model*.safetensors"), self.out_dir / HF_INDEX]:
            old.unlink(missing_ok=True)  # a previous export with another shard count
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._current[name] = tensor.contiguous()
        self._current_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = self.out_dir / f".part-{len(self._written):05d}.safetensors"
        save_file(self._current, str(part), metadata={"format": "pt"})
        self._written.append((part, list(self._current)))
        self._current, self._current_bytes = {}, 0

    def finish(self) -> list[Path]:
        if self._current or not self._written:
            self._flush()
        if len(self._written) == 1:
            final = self.out_dir / HF_SINGLE
            self._written[0][0].replace(final)
            return [final]
        count = len(self._written)
        weight_map: dict[str, str] = {}
        finals = []
        for i, (part, names) in enumerate(self._written, start=1):
            final = self.out_dir / f"model-{i:05d}-of-{count:05d}.safetensors"
            part.replace(final)
            finals.append(final)
            weight_map.update({n: final.name for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        return finals


def _full_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather a DTensor (collective: every rank calls) into a plain CPU tensor of `dtype`."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return _plain(tensor).detach().to(device="cpu", dtype=dtype)


def _save_hf_config(config: Any, out_dir: Path, dtype: torch.dtype) -> None:
    import copy

    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(str(out_dir))


def export_hf(
    model: nn.Module,
    config: Any,
    out_dir: str | Path,
    key_map: KeyMap | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the (sharded) model as HF safetensors + config.json; all ranks call.

    One decoder layer at a time is gathered (all-gather of its shards) and rank 0 writes it,
    so memory is bounded by a layer plus one output shard, not the model. Tied weights are
    written once (like save_pretrained). `key_map` maps model names -> HF names (e.g. TE -> HF).
    """
    out_dir = Path(out_dir)
    sd = weight_tensors(get_model_state_dict(model))
    aliases = _alias_groups(sd)
    names = [n for n in sd if aliases[n] == n]
    writer = SafetensorsShardWriter(out_dir, max_shard_bytes) if _rank() == 0 else None
    for group in layer_groups(names):
        full = {n: _full_cpu(sd[n], dtype) for n in group}
        if writer is not None:
            for name, tensor in (key_map(full) if key_map else full).items():
                writer.add(name, tensor)
    if writer is not None:
        writer.finish()
        _save_hf_config(config, out_dir, dtype)
        log.info("Exported HF safetensors (%s) to %s", str(dtype).split(".")[-1], out_dir)
    _barrier()


def dcp_model_keys(path: str | Path) -> dict[str, Any]:
    """Model tensor name -> DCP TensorStorageMetadata of a saved checkpoint (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key[len("model.") :]: md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.")
        and isinstance(md, TensorStorageMetadata)
        and not key.endswith("_extra_state")
    }


def iter_dcp_model_layers(path: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model tensors of a DCP checkpoint, one decoder layer at a time, in one process."""
    keys = dcp_model_keys(path)
    for group in layer_groups(keys):
        tensors = {n: torch.empty(keys[n].size, dtype=keys[n].properties.dtype) for n in group}
        dcp.load({"model": tensors}, checkpoint_id=str(path), no_dist=True)
        yield tensors


def dcp_to_hf(
    path: str | Path,
    out_dir: str | Path,
    key_map: KeyMap | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Convert a saved checkpoint to a HF directory without a process group or a model object.

    Needs the model config recorded in the checkpoint's marker. Memory: one layer at a time.
    """
    from transformers import AutoConfig

    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(problem)
    model_config = read_marker(path).get("model_config")
    if not model_config:
        raise ValueError(f"checkpoint {path} records no model config: cannot write config.json")
    model_config = dict(model_config)
    config = AutoConfig.for_model(model_config.pop("model_type", "llama"), **model_config)
    writer = SafetensorsShardWriter(out_dir, max_shard_bytes)
    for layer in iter_dcp_model_layers(path):
        layer = {n: t.to(dtype) for n, t in layer.items()}
        for name, tensor in (key_map(layer) if key_map else layer).items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            writer.add(name, tensor)
    files = writer.finish()
    _save_hf_config(config, Path(out_dir), dtype)
    return files
