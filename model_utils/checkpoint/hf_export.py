"""Hugging Face folders out: `--export_hf` from a sharded model, and a saved checkpoint to a
HF directory without a process group (scripts/convert_checkpoint.py). Both write the same
complete folder (weights, config, generation config, the run's tokenizer: hf_folder). Memory
stays one decoder layer plus one output shard.

The hand-written shard writer, not torch DCP's HuggingFaceStorageWriter: see docs/hf_export.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from model_utils.checkpoint.errors import CheckpointWriteError, write_error_reason
from model_utils.checkpoint.hf_folder import write_model_files
from model_utils.checkpoint.hf_import import HF_INDEX, HF_SINGLE
from model_utils.checkpoint.manifest import checkpoint_problem, read_marker
from model_utils.checkpoint.ranks import any_rank, current_rank
from model_utils.checkpoint.saved import iter_dcp_model_layers
from model_utils.checkpoint.tensors import (
    KeyMap,
    alias_groups,
    layer_groups,
    plain_tensor,
    unwrapped,
    weight_tensors,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


PART_PREFIX = ".part-"  # shards being written; renamed to their HF names when all are done
STAGED_FILES = f"{PART_PREFIX}files"  # the folder's other files, staged the same way


def existing_model(out_dir: str | Path) -> list[str]:
    """The HF weight files already in `out_dir` (sorted names; [] if none or no such folder)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [*out_dir.glob("model*.safetensors"), out_dir / HF_INDEX]
    return sorted(p.name for p in found if p.exists())


def export_dir_problem(flag: str, out_dir: str | Path) -> str | None:
    """Why `out_dir` cannot take an export, or None: an export never replaces a model the user
    saved (a former export, a downloaded model), found before training rather than after it."""
    found = existing_model(out_dir)
    if not found:
        return None
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return (
        f"{flag} {out_dir} already holds a model ({shown}): an export never replaces one; "
        f"choose a new or empty directory, or move that model away"
    )


def check_export_dir(out_dir: str | Path, flag: str = "--export_hf") -> None:
    """ValueError (one line) if `out_dir` already holds a model: before any training."""
    problem = export_dir_problem(flag, out_dir)
    if problem:
        raise ValueError(problem)


def _publish_mode() -> int:
    """The mode a plain new file gets here (0o666 less the umask): safetensors writes through a
    private temporary file (0o600), which would keep an export from the user's group."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class SafetensorsShardWriter:
    """Accumulates tensors and writes HF-style shards of at most `max_shard_bytes`:
    model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json.

    Shards are written as hidden parts and take their HF names only when all are written, so
    an export cut short leaves no half model; a folder that already holds one is refused
    (FileExistsError)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        problem = export_dir_problem("export", self.out_dir)
        if problem:
            raise FileExistsError(problem)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob(f"{PART_PREFIX}*"):  # an export cut short
            remove_path(stale)
        self.staging = self.out_dir / STAGED_FILES  # config, tokenizer: published with the weights
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
        part = self.out_dir / f"{PART_PREFIX}{len(self._written):05d}.safetensors"
        try:
            save_file(self._current, str(part), metadata={"format": "pt"})
        except SafetensorError as exc:  # a full disk reaches us as this, not as an OSError
            raise _os_error(exc, part) from exc
        self._written.append((part, list(self._current)))
        self._current, self._current_bytes = {}, 0

    def finish(self) -> list[Path]:
        if self._current or not self._written:
            self._flush()
        mode = _publish_mode()
        for part, _ in self._written:
            os.chmod(part, mode)
        self._publish_staged()
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

    def _publish_staged(self) -> None:
        """Move the staged files (config.json, generation_config.json, the tokenizer's) into the
        folder before any weight file takes its name: a folder that holds weights holds them too."""
        if not self.staging.is_dir():
            return
        for staged in sorted(self.staging.iterdir()):
            staged.replace(self.out_dir / staged.name)
        self.staging.rmdir()


def _os_error(exc: SafetensorError, path: Path) -> OSError:
    """safetensors' I/O failure ("... I/O error: No space left on device (os error 28)") as the
    OSError it is, so the export's one-line failure names the reason."""
    found = re.search(r"os error (\d+)", str(exc))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code), str(path))


def remove_path(path: Path) -> None:
    """Remove a file or a folder (an export's staging folder), whichever it is."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def export_snapshot(out_dir: Path) -> tuple[list[Path], set[str]]:
    """What is there before an export into `out_dir`: the folders it will create (out_dir
    first, then its parents) and, where out_dir exists, the names already in it."""
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    return created, set() if created else {p.name for p in out_dir.iterdir()}


def undo_export(out_dir: Path, snapshot: tuple[list[Path], set[str]]) -> None:
    """Remove what an export that failed part-way wrote, hidden parts included, so no half
    model and no hidden leftover stays: the folders it created go whole; in a folder that
    existed, every name it added, while the names there before stay."""
    created, before = snapshot
    if created:
        shutil.rmtree(created[-1], ignore_errors=True)  # the outermost folder it created
        return
    with contextlib.suppress(OSError):
        for entry in list(out_dir.iterdir()):
            if entry.name.startswith(PART_PREFIX) or entry.name not in before:
                remove_path(entry)


def full_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather a DTensor (collective: every rank calls) into a plain CPU tensor of `dtype`."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return unwrapped(tensor).detach().to(device="cpu", dtype=dtype)


def export_hf(
    model: nn.Module,
    config: Any,
    out_dir: str | Path,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    kept: Path | None = None,
    masters: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write the (sharded) model as a complete HF folder: safetensors, config.json,
    generation_config.json and `tokenizer`'s files (hf_folder); all ranks call.

    ``masters`` (master_weights.masters_by_name, --master_weights optimizer) replaces each
    parameter it names by its fp32 master: the parameter itself is that master rounded to bf16
    or to FP8. FP8 parameters without a master are written as their values (dequantised).

    One decoder layer at a time is gathered (all-gather of its shards) and rank 0 writes it,
    so memory is bounded by a layer plus one output shard. Tied weights are written once (like
    save_pretrained); a te model is mapped to HF names by its ``state_dict_adapter``. If rank 0
    cannot write (a full disk: what it wrote is removed; a model that appeared in `out_dir`),
    every rank still gathers to the end, then all raise CheckpointWriteError naming `kept`, the
    checkpoint that holds the same weights (None: none does).
    """
    out_dir = Path(out_dir)
    key_map = getattr(getattr(model, "state_dict_adapter", None), "to_hf", None)
    sd = weight_tensors(get_model_state_dict(model))
    aliases = alias_groups(sd)  # before the masters: a tied master is named once
    sd = {n: (masters or {}).get(n, plain_tensor(t)) for n, t in sd.items()}
    names = [n for n in sd if aliases[n] == n]
    writer, failure = None, None
    if current_rank() == 0:
        snapshot = export_snapshot(out_dir)
        try:
            writer = SafetensorsShardWriter(out_dir, max_shard_bytes)
        except OSError as exc:
            failure = exc
        try:  # any error: rank 0 alone must not leave the gathers below (the others would hang)
            if writer is not None:
                write_model_files(writer.staging, config, tokenizer, dtype)
        except Exception as exc:
            failure = exc
    for group in layer_groups(names):
        full = {n: full_cpu(sd[n], dtype) for n in group}  # a collective: every rank, always
        if writer is not None and failure is None:
            try:
                for name, tensor in (key_map(full) if key_map else full).items():
                    writer.add(name, tensor)
            except OSError as exc:
                failure = exc
    if writer is not None and failure is None:
        try:
            writer.finish()
            log.info("Exported HF safetensors (%s) to %s", str(dtype).split(".")[-1], out_dir)
        except OSError as exc:
            failure = exc
    if failure is not None and not isinstance(failure, FileExistsError):
        undo_export(out_dir, snapshot)  # a model that appeared there is not ours to remove
    if any_rank(failure is not None):
        raise CheckpointWriteError(_export_failure(out_dir, failure, kept))


def _export_failure(out_dir: Path, failure: BaseException | None, kept: Path | None) -> str:
    if isinstance(failure, FileExistsError):
        reason = f"a model appeared there during the run ({', '.join(existing_model(out_dir))})"
    elif failure is not None:
        reason = f"{write_error_reason(failure, out_dir)} (what it wrote is removed)"
    else:
        reason = "rank 0 could not write it (see rank 0's log)"
    then = (
        f"the checkpoint {kept} holds the same weights: python -m scripts.convert_checkpoint "
        f"{kept} DIR writes the export"
        if kept
        else "no checkpoint holds these weights (--checkpoint_freq -1)"
    )
    return f"the Hugging Face export to {out_dir} failed: {reason}; {then}"


def dcp_to_hf(
    path: str | Path,
    out_dir: str | Path,
    tokenizer: Any,
    key_map: KeyMap | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Convert a saved checkpoint to a HF directory without a process group or a model object:
    the same folder --export_hf writes (`tokenizer` is the run's, see convert_checkpoint.py).

    Needs the model config recorded in the checkpoint's marker. Memory: one layer at a time.
    """
    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(problem)
    config = marker_model_config(path)
    writer = SafetensorsShardWriter(out_dir, max_shard_bytes)
    write_model_files(writer.staging, config, tokenizer, dtype)
    for layer in iter_dcp_model_layers(path):
        layer = {n: t.to(dtype) for n, t in layer.items()}
        for name, tensor in (key_map(layer) if key_map else layer).items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            writer.add(name, tensor)
    return writer.finish()


def marker_model_config(path: str | Path) -> Any:
    """The model config the run built, as its checkpoint's marker records it (the model's
    `config.to_dict()`, stateful.TrainState.model_config): the same object --export_hf writes."""
    from transformers import AutoConfig

    model_config = read_marker(path).get("model_config")
    if not model_config:
        raise ValueError(f"checkpoint {path} records no model config: cannot write config.json")
    model_config = dict(model_config)
    return AutoConfig.for_model(model_config.pop("model_type", "llama"), **model_config)
