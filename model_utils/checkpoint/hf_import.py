"""Hugging Face safetensors in: `--init_from_hf` into a sharded (FSDP2) or plain model.

A model whose parameter layout is not HF's (te) carries ``state_dict_adapter``
(te_llama.StateDictAdapter), which maps each decoder layer from HF names on the way in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from model_utils.checkpoint.tensors import (
    alias_groups,
    check_shape,
    copy_full_into,
    layer_groups,
    local_index,
    local_shard,
    require_complete,
    weight_tensors,
)
from model_utils.modeling import HF_RECOMPUTED  # RoPE buffers of old HF files

log = logging.getLogger(__name__)

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
_SHAPE_HINT = (
    "does the model shape (--hidden_width, --num_layers, --vocab_size, ...) match the "
    "checkpoint's config.json?"
)


def hf_weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file for a HF checkpoint (single file, or sharded with
    model.safetensors.index.json). ValueError with one line if `path` is neither."""
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


class _SafetensorsFiles:
    """Open safetensors handles by tensor name, each file opened once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._handles: dict[Path, Any] = {}

    def __call__(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Load a HF Llama safetensors checkpoint into a sharded (FSDP2) or plain model in place.

    In the HF layout each rank reads only its own rows of each tensor (safetensors slices are
    lazy reads), so no rank ever holds the whole model, nor a whole tensor. In another layout
    (the model's ``state_dict_adapter``) one decoder layer is read in full at a time, mapped,
    and each rank keeps its shard. Raises ValueError on missing, unexpected or mis-shaped keys.
    """
    adapter = getattr(model, "state_dict_adapter", None)
    key_map = adapter.from_hf if adapter is not None else None
    handle = _SafetensorsFiles(hf_weight_files(path))
    targets = weight_tensors(get_model_state_dict(model))
    loaded: set[str] = set()
    unexpected: list[str] = []
    names = [n for n in handle.files if not n.endswith(HF_RECOMPUTED)]
    for group in layer_groups(names):
        if key_map is None:
            _copy_own_rows(group, handle, targets, loaded, unexpected)
        else:
            mapped = key_map({name: handle(name).get_tensor(name) for name in group})
            _copy_full_tensors(mapped, targets, loaded, unexpected)
    aliases = alias_groups(targets)
    require_complete(f"HF checkpoint {path}", targets, loaded, aliases, unexpected)
    log.info("Loaded %d tensors from Hugging Face checkpoint %s", len(loaded), path)


def _copy_own_rows(
    group: list[str],
    handle: _SafetensorsFiles,
    targets: dict[str, torch.Tensor],
    loaded: set[str],
    unexpected: list[str],
) -> None:
    """Same names in file and model: read only this rank's block of each tensor."""
    for name in group:
        if name not in targets:
            unexpected.append(name)
            continue
        target = targets[name]
        lazy = handle(name).get_slice(name)
        check_shape("HF tensor", name, lazy.get_shape(), target, _SHAPE_HINT)
        local_shard(target).copy_(lazy[local_index(target)])
        loaded.add(name)


def _copy_full_tensors(
    mapped: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    loaded: set[str],
    unexpected: list[str],
) -> None:
    """Whole tensors already in the model's names: copy this rank's block of each."""
    for name, full in mapped.items():
        if name not in targets:
            unexpected.append(name)
            continue
        check_shape("HF tensor", name, full.shape, targets[name], _SHAPE_HINT)
        copy_full_into(targets[name], full)
        loaded.add(name)
