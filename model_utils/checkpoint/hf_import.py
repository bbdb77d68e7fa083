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
from model_utils.config.sections import HF_KEYS, SHAPE_FIELDS, ModelShape
from model_utils.model.modeling import HF_RECOMPUTED, llama_config  # RoPE buffers of old HF files
from model_utils.parallel.distributed import canonical_param_name, has_tied_embeddings
from model_utils.precision import master_weights

log = logging.getLogger(__name__)

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
HF_CONFIG = "config.json"
#: The shape flags a config.json states as numbers (its keys: config/sections.HF_KEYS).
_NUMBER_FLAGS = (*SHAPE_FIELDS, "rope_theta")
#: Tied checkpoints (tie_word_embeddings: Llama 3.2 1B/3B) store the output projection only as
#: the embedding: a tied model reads it once; a model built untied from such a file (only by
#: the explicit --tie_word_embeddings 0, which config.json's check refuses) would start its
#: lm_head as a copy.
TIED_HEAD, TIED_TO = "lm_head.weight", "model.embed_tokens.weight"
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


def check_hf_dir(path: str | Path, shape: ModelShape | None = None) -> None:
    """Raise ValueError (one line) unless `path` is a loadable HF safetensors checkpoint and,
    given the run's model `shape`, holds exactly the tensors of that shape with its RoPE
    base: read from the safetensors headers and config.json, before any process group (the
    load itself would meet a mismatch as a traceback, after the model was built)."""
    try:
        files = hf_weight_files(path)
        problem = None if shape is None else _shape_problem(path, files, shape)
    except ValueError:
        raise
    except Exception as exc:  # a corrupt header, unreadable file, ...
        raise ValueError(f"--init_from_hf: cannot read {path}: {exc}") from exc
    if problem:
        raise ValueError(f"--init_from_hf: {problem}")


def _shape_problem(path: str | Path, files: dict[str, Path], shape: ModelShape) -> str | None:
    """What in `path` does not fit the model of `shape` (in this recipe's flags), or None."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        expected = {
            n: tuple(t.shape) for n, t in LlamaForCausalLM(llama_config(shape)).state_dict().items()
        }
    stored = {}
    for name, file in files.items():
        if not name.endswith(HF_RECOMPUTED):
            with safe_open(str(file), framework="pt") as handle:
                stored[name] = tuple(handle.get_slice(name).get_shape())
    if TIED_HEAD not in stored and TIED_TO in stored:
        stored[TIED_HEAD] = stored[TIED_TO]
    wrong = [
        f"{name} {stored.get(name, 'missing')} (this model: {shape})"
        for name, shape in expected.items()
        if stored.get(name) != shape
    ] + [f"{name} (not in this model)" for name in stored if name not in expected]
    saved = _config_flags(Path(path))
    differ = {flag: v for flag, v in saved.items() if v != getattr(shape, flag)}
    if not wrong and "rope_theta" not in differ:
        return None
    told = " ".join(f"--{flag} {value:g}" for flag, value in differ.items())
    fix = f"its config.json says {told}" if told else "compare its config.json with the flags"
    what = f"{len(wrong)} tensor(s) differ, e.g. {wrong[0]}" if wrong else "another RoPE base"
    return f"{path} does not fit this run's model: {what}; {fix}"


def _config_flags(path: Path) -> dict[str, float]:
    """The shape flags a HF checkpoint's config.json implies ({} without a readable one)."""
    file = (path if path.is_dir() else path.parent) / HF_CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    config = {**config, "rope_theta": theta}
    return {
        flag: config[HF_KEYS[flag]]
        for flag in _NUMBER_FLAGS
        if isinstance(config.get(HF_KEYS[flag]), (int, float))
    }


class _SafetensorsFiles:
    """Open safetensors handles by tensor name, each file opened once."""

    def __init__(self, files: dict[str, Path], tied: bool) -> None:
        self.files = dict(files)
        self.stored = {name: name for name in files}  # the model's name -> the file's name
        if tied:  # one parameter: read once, as the embedding
            self.files.pop(TIED_HEAD, None)
        elif TIED_HEAD not in files and TIED_TO in files:
            self.files[TIED_HEAD], self.stored[TIED_HEAD] = files[TIED_TO], TIED_TO
            log.info(
                "%s: tied checkpoint, %s starts as a copy of %s", TIED_HEAD, TIED_HEAD, TIED_TO
            )
        self._handles: dict[Path, Any] = {}

    def __call__(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def slice(self, name: str) -> Any:
        return self(name).get_slice(self.stored[name])

    def tensor(self, name: str) -> torch.Tensor:
        return self(name).get_tensor(self.stored[name])


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Load a HF Llama safetensors checkpoint into a sharded (FSDP2) or plain model in place.

    In the HF layout each rank reads only its own rows of each tensor (safetensors slices are
    lazy reads), so no rank ever holds the whole model, nor a whole tensor. In another layout
    (the model's ``state_dict_adapter``) one decoder layer is read in full at a time, mapped,
    and each rank keeps its shard. Raises ValueError on missing, unexpected or mis-shaped keys.
    A parameter keeping a full-precision seed for its master copy (--master_weights optimizer)
    takes the loaded values as its seed, so the masters start from the checkpoint, not the init.
    """
    adapter = getattr(model, "state_dict_adapter", None)
    key_map = adapter.from_hf if adapter is not None else None
    handle = _SafetensorsFiles(hf_weight_files(path), has_tied_embeddings(model))
    targets = weight_tensors(get_model_state_dict(model))
    seeded = {
        canonical_param_name(n): p
        for n, p in model.named_parameters()
        if master_weights.has_seed(p)
    }
    loaded: set[str] = set()
    unexpected: list[str] = []
    names = [n for n in handle.files if not n.endswith(HF_RECOMPUTED)]
    for group in layer_groups(names):
        if key_map is None:
            copied = _copy_own_rows(group, handle, targets, loaded, unexpected)
        else:
            mapped = key_map({name: handle.tensor(name) for name in group})
            copied = _copy_full_tensors(mapped, targets, loaded, unexpected)
        for name, value in copied.items():
            if name in seeded:
                master_weights.remember_full_precision(seeded[name], value)
    aliases = alias_groups(targets)
    require_complete(f"HF checkpoint {path}", targets, loaded, aliases, unexpected)
    log.info("Loaded %d tensors from Hugging Face checkpoint %s", len(loaded), path)


def _copy_own_rows(
    group: list[str],
    handle: _SafetensorsFiles,
    targets: dict[str, torch.Tensor],
    loaded: set[str],
    unexpected: list[str],
) -> dict[str, torch.Tensor]:
    """Same names in file and model: read only this rank's block of each tensor. Returns the
    blocks read, by name."""
    copied = {}
    for name in group:
        if name not in targets:
            unexpected.append(name)
            continue
        target = targets[name]
        lazy = handle.slice(name)
        check_shape("HF tensor", name, lazy.get_shape(), target, _SHAPE_HINT)
        copied[name] = lazy[local_index(target)]
        local_shard(target).copy_(copied[name])
        loaded.add(name)
    return copied


def _copy_full_tensors(
    mapped: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    loaded: set[str],
    unexpected: list[str],
) -> dict[str, torch.Tensor]:
    """Whole tensors already in the model's names: copy this rank's block of each. Returns the
    blocks copied, by name."""
    copied = {}
    for name, full in mapped.items():
        if name not in targets:
            unexpected.append(name)
            continue
        check_shape("HF tensor", name, full.shape, targets[name], _SHAPE_HINT)
        copied[name] = copy_full_into(targets[name], full)
        loaded.add(name)
    return copied
