"""Hugging Face safetensors out: `--export_hf` from a sharded model, and a saved checkpoint to a
HF directory without a process group (scripts/convert_checkpoint.py). Memory stays one decoder
layer plus one output shard.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from model_utils.checkpoint.hf_import import HF_INDEX, HF_SINGLE
from model_utils.checkpoint.manifest import checkpoint_problem, read_marker
from model_utils.checkpoint.ranks import barrier, current_rank
from model_utils.checkpoint.saved import iter_dcp_model_layers
from model_utils.checkpoint.tensors import (
    KeyMap,
    alias_groups,
    layer_groups,
    unwrapped,
    weight_tensors,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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


def full_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather a DTensor (collective: every rank calls) into a plain CPU tensor of `dtype`."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return unwrapped(tensor).detach().to(device="cpu", dtype=dtype)


def _save_hf_config(config: Any, out_dir: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(str(out_dir))


def export_hf(
    model: nn.Module,
    config: Any,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the (sharded) model as HF safetensors + config.json; all ranks call.

    One decoder layer at a time is gathered (all-gather of its shards) and rank 0 writes it,
    so memory is bounded by a layer plus one output shard, not the model. Tied weights are
    written once (like save_pretrained). A model in another layout (te) is mapped to HF names by
    its ``state_dict_adapter``.
    """
    out_dir = Path(out_dir)
    adapter = getattr(model, "state_dict_adapter", None)
    key_map = adapter.to_hf if adapter is not None else None
    sd = weight_tensors(get_model_state_dict(model))
    aliases = alias_groups(sd)
    names = [n for n in sd if aliases[n] == n]
    writer = SafetensorsShardWriter(out_dir, max_shard_bytes) if current_rank() == 0 else None
    for group in layer_groups(names):
        full = {n: full_cpu(sd[n], dtype) for n in group}
        if writer is not None:
            for name, tensor in (key_map(full) if key_map else full).items():
                writer.add(name, tensor)
    if writer is not None:
        writer.finish()
        _save_hf_config(config, out_dir, dtype)
        log.info("Exported HF safetensors (%s) to %s", str(dtype).split(".")[-1], out_dir)
    barrier()


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
