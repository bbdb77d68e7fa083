"""Reading a saved checkpoint's tensors in one process, whole, whatever the saved world size.

DCP assembles each tensor from every saved shard; ``no_dist`` lets each rank (or a script
without a process group) read only what it asks for, without collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from model_utils.checkpoint.tensors import layer_groups
from model_utils.model.te_support import is_te_extra_state_key

MODEL_PREFIX = "model."


def saved_tensors(metadata: Any, prefix: str) -> dict[str, tuple[str, Any]]:
    """Saved tensors under DCP key `prefix` (TE extra state excluded), by name without the
    prefix: name -> (DCP key, TensorStorageMetadata)."""
    return {
        key[len(prefix) :]: (key, md)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
        and isinstance(md, TensorStorageMetadata)
        and not is_te_extra_state_key(key)
    }


def read_full_tensors(path: Path, entries: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Whole saved tensors on CPU (DCP assembles them from every saved shard). no_dist: each rank
    reads on its own, without collectives, so ranks need not request the same keys."""
    out = {n: torch.empty(md.size, dtype=md.properties.dtype) for n, (_, md) in entries.items()}
    if out:
        request = {key: out[n] for n, (key, _) in entries.items()}
        load_local(request, path)
    return out


def load_local(request: dict[str, Any], path: Path) -> None:
    """dcp.load in this process only (no_dist), without DCP's single-process warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, checkpoint_id=str(path), no_dist=True)


def iter_dcp_model_layers(path: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model tensors of a DCP checkpoint, one decoder layer at a time, in one process."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    entries = saved_tensors(metadata, MODEL_PREFIX)
    for group in layer_groups(entries):
        yield read_full_tensors(Path(path), {n: entries[n] for n in group})
