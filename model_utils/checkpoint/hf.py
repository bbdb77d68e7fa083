"""Hugging Face folders in and out: `--init_from_hf` (safetensors into a sharded or plain
model), `--export_hf` from a sharded model, and a saved checkpoint to a HF folder without a
process group (scripts/convert_checkpoint.py).

A model whose parameter layout is not HF's (te) carries ``state_dict_adapter``
(te_llama.StateDictAdapter), which maps each decoder layer on the way in and out by its family's
row (config/families.py). Both exports
write the same complete folder: weights, config.json with the tokenizer's token ids, the
architecture and the KV cache on, generation_config.json, and the run's tokenizer, so
`from_pretrained`, `generate` and lm-eval need nothing else. Memory stays one decoder layer plus
one output shard. The hand-written shard writer, not torch DCP's HuggingFaceStorageWriter: see
docs/hf_export.md.
"""

from __future__ import annotations

import contextlib
import copy
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from model_utils.checkpoint.layout import (
    BlockCopy,
    alias_groups,
    layer_groups,
    plain_tensor,
    unwrapped,
    weight_tensors,
)
from model_utils.checkpoint.manifest import CheckpointWriteError, write_error_reason
from model_utils.checkpoint.published import MARKER
from model_utils.config.families import FAMILIES
from model_utils.config.hf_config import config_json
from model_utils.config.sections import HF_KEYS, SHAPE_FIELDS, ModelShape
from model_utils.errors import UsageError, refuse
from model_utils.model.modeling import HF_RECOMPUTED, model_config  # RoPE buffers of old HF files
from model_utils.parallel.distributed import (
    any_rank,
    canonical_param_name,
    current_rank,
    has_tied_embeddings,
)
from model_utils.precision import master_weights

log = logging.getLogger(__name__)

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
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
        single = path
    elif (path / HF_INDEX).is_file():
        weight_map = json.loads((path / HF_INDEX).read_text()).get("weight_map", {})
        if not weight_map:
            raise UsageError(f"{path / HF_INDEX} has no weight_map")
        names_by_file: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            names_by_file.setdefault(path / fname, []).append(name)
        missing = [str(f) for f in names_by_file if not f.is_file()]
        if missing:
            raise UsageError(f"{path / HF_INDEX} lists missing shard(s): {', '.join(missing)}")
        return {name: f for f, names in names_by_file.items() for name in names}
    elif (path / HF_SINGLE).is_file():
        single = path / HF_SINGLE
    elif not path.exists():
        raise UsageError(f"--init_from_hf: {path} does not exist")
    else:
        raise UsageError(
            f"--init_from_hf: {path} has neither {HF_SINGLE} nor {HF_INDEX} "
            "(only safetensors checkpoints are supported)"
        )
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def check_hf_dir(path: str | Path, shape: ModelShape | None = None) -> None:
    """Raise UsageError (one line) unless `path` is a loadable HF safetensors checkpoint and,
    given the run's model `shape`, holds exactly the tensors of that shape with its RoPE
    base: read from the safetensors headers and config.json, before any process group (the
    load itself would meet a mismatch as a traceback, after the model was built)."""
    try:
        files = hf_weight_files(path)
        problem = None if shape is None else _shape_problem(path, files, shape)
    except UsageError:
        raise
    except Exception as exc:  # a corrupt header or index, an unreadable file, ...
        raise UsageError(f"--init_from_hf: cannot read {path}: {exc}") from exc
    if problem:
        raise UsageError(f"--init_from_hf: {problem}")


def _shape_problem(path: str | Path, files: dict[str, Path], shape: ModelShape) -> str | None:
    """What in `path` does not fit the model of `shape` (in this recipe's flags), or None."""
    causal_lm = FAMILIES[shape.model_family].hf_class("causal_lm_class")
    with torch.device("meta"):
        expected = {
            n: tuple(t.shape) for n, t in causal_lm(model_config(shape)).state_dict().items()
        }
    handle = _SafetensorsFiles(files, tied=False)  # a tied file's output layer: its embedding
    names = [n for n in handle.files if not n.endswith(HF_RECOMPUTED)]
    stored = {name: tuple(handle.slice(name).get_shape()) for name in names}
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
    config = config_json(path)
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
    """Load a HF safetensors checkpoint into a sharded (FSDP2) or plain model in place.

    In the HF layout each rank reads only its own rows of each tensor (safetensors slices are
    lazy reads), so no rank ever holds the whole model, nor a whole tensor. In another layout
    (the model's ``state_dict_adapter``) one decoder layer is read in full at a time, mapped,
    and each rank keeps its shard. Raises ValueError on missing, unexpected or mis-shaped keys.
    A parameter keeping a full-precision seed for its master copy (--master_weights optimizer)
    takes the loaded values as its seed, so the masters start from the checkpoint, not the init.
    """
    key_map = getattr(getattr(model, "state_dict_adapter", None), "from_hf", None)
    handle = _SafetensorsFiles(hf_weight_files(path), has_tied_embeddings(model))
    if handle.stored.get(TIED_HEAD) == TIED_TO:
        log.info("%s: tied checkpoint, %s starts as a copy of %s", TIED_HEAD, TIED_HEAD, TIED_TO)
    targets = weight_tensors(get_model_state_dict(model))
    seeded = {
        canonical_param_name(n): p
        for n, p in model.named_parameters()
        if master_weights.has_seed(p)
    }
    blocks = BlockCopy(targets, "HF tensor", _SHAPE_HINT)
    names = [n for n in handle.files if not n.endswith(HF_RECOMPUTED)]
    for group in layer_groups(names):
        if key_map is None:  # the model's names: read only this rank's block of each tensor
            sources = {name: handle.slice(name) for name in group}
        else:  # another layout: whole tensors, mapped a decoder layer at a time
            sources = key_map({name: handle.tensor(name) for name in group})
        for name, value in blocks.copy(sources).items():
            if name in seeded:
                master_weights.remember_full_precision(seeded[name], value)
    count = blocks.require_complete(f"HF checkpoint {path}")
    log.info("Loaded %d tensors from Hugging Face checkpoint %s", count, path)


# --------------------------------------------------------------------------------------------
# What a HF folder holds beside its weights, so that a client needs no hand help: the run's
# tokenizer, config.json with that tokenizer's ids (LlamaConfig's defaults bos 1 / eos 2 name other
# tokens in most tokenizers), and generation_config.json with the same ids (pad = eos when the
# tokenizer has none). Shape, RoPE and max_position_embeddings are the model config's own.


def token_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad ids as the tokenizer defines them; pad falls back to eos (a tokenizer trained
    for pre-training, like the bundled one, has no pad token)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": pad}


def client_config(config: Any, tokenizer: Any, dtype: torch.dtype) -> Any:
    """A copy of the run's model config for clients: weights' dtype, the tokenizer's ids, the
    architecture, the KV cache on. Every shape and RoPE field is left as the run built it."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.use_cache = True
    config.architectures = [FAMILIES[config.model_type].causal_lm_class]
    for name, value in token_ids(tokenizer).items():
        setattr(config, name, value)
    return config


def write_model_files(out_dir: Path, config: Any, tokenizer: Any, dtype: torch.dtype) -> None:
    """config.json, generation_config.json and the tokenizer's files into `out_dir` (the export's
    staging folder: they are published with the weights, see SafetensorsShardWriter). generate()'s
    defaults are the tokenizer's ids and nothing else (greedy, the model's length)."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    client_config(config, tokenizer, dtype).save_pretrained(str(out_dir))
    GenerationConfig(**token_ids(tokenizer)).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


# ---- Hugging Face folders out

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
PART_PREFIX = ".part-"  # shards being written; renamed to their HF names when all are done
STAGED_FILES = f"{PART_PREFIX}files"  # the folder's other files, staged the same way


#: What an export writes beside its weights: the configs and `save_pretrained`'s tokenizer files.
BESIDE_WEIGHTS = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer.model"}
BESIDE_WEIGHTS |= {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"}
BESIDE_WEIGHTS |= {"chat_template.jinja", "vocab.json", "merges.txt", HF_INDEX}


def existing_model(out_dir: str | Path) -> list[str]:
    """The files of a model already in `out_dir` that an export would replace: HF weights, and a
    config or tokenizer of the user's (sorted names; [] if none or no such folder)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [*out_dir.glob("model*.safetensors"), *(out_dir / n for n in BESIDE_WEIGHTS)]
    return sorted(p.name for p in found if p.exists())


def export_dir_problem(
    flag: str, out_dir: str | Path, checkpoint_dir: str | Path | None = None
) -> str | None:
    """Why `out_dir` cannot take an export, or None: an export never replaces a model the user
    saved (a former export, a downloaded model), and never goes inside a checkpoint or the run's
    `checkpoint_dir`, whose old checkpoints --keep_last deletes with what they hold."""
    where = Path(out_dir).resolve()
    inside = [p for p in (where, *where.parents) if (p / MARKER).is_file()]
    if checkpoint_dir is not None and where.is_relative_to(Path(checkpoint_dir).resolve()):
        inside.append(Path(checkpoint_dir))
    if inside:
        return (
            f"{flag} {out_dir} is inside {inside[0]}, where a run's checkpoints are pruned and "
            "replaced: give a folder outside it"
        )
    found = existing_model(out_dir)
    if not found:
        return None
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return (
        f"{flag} {out_dir} already holds a model ({shown}): an export never replaces one; "
        f"choose a new or empty directory, or move that model away"
    )


def check_export_dir(out_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """UsageError (one line) if `out_dir` cannot take the run's export: before any training."""
    refuse(export_dir_problem("--export_hf", out_dir, checkpoint_dir))


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
        refuse(export_dir_problem("export", self.out_dir), FileExistsError)
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
        staged = sorted(self.staging.iterdir())
        for there in (self.out_dir / f.name for f in staged if (self.out_dir / f.name).exists()):
            raise FileExistsError(f"{there} exists: an export never replaces it")  # unforeseen
        for file in staged:
            file.replace(self.out_dir / file.name)
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
    generation_config.json and `tokenizer`'s files (write_model_files); all ranks call.

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
        try:  # any error: rank 0 alone must not leave the gathers below (the others would hang)
            writer = SafetensorsShardWriter(out_dir, max_shard_bytes)
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
