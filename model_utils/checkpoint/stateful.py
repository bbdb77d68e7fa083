"""What a checkpoint holds: the Stateful items DCP saves and loads, and `TrainState`.

Each item has ``state_dict()`` / ``load_state_dict()`` so DCP can save and load the whole
state as one dict. Per-rank values (data position, RNG) are packed into bytes under per-rank
keys, because DCP keeps only one copy of a non-tensor value that several ranks write under the
same key (torch/distributed/checkpoint/_dedup_save_plans.py).
"""

from __future__ import annotations

import io
import json
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from model_utils.checkpoint.errors import TE_UNSAFE_PICKLE_ENV, UntrustedCheckpointError
from model_utils.checkpoint.ranks import current_rank
from model_utils.checkpoint.tensors import plain_tensor
from model_utils.model.te_support import is_te_extra_state_key
from model_utils.precision.te_state import (
    decode_recipe_identity,
    fp8_scaling_state,
    load_fp8_scaling_state,
    recipe_identity,
)

log = logging.getLogger(__name__)


def pack(obj: Any) -> bytes:
    """Serialise to bytes so DCP stores `obj` as one opaque object (not traversed for tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(blob: bytes) -> Any:
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


class ModelItem:
    """The model's sharded parameters under clean FQNs (no FSDP/compile/AC wrapper prefixes).

    TE modules' ``_extra_state`` (their FP8 metadata, pickled by TE) is left out: the FP8
    scaling state travels as plain tensors in :class:`Fp8ScalingItem`. ``legacy=True`` reads a
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
        sd = {k: plain_tensor(v) for k, v in get_model_state_dict(self.model).items()}
        if not self.legacy:
            return {k: v for k, v in sd.items() if not is_te_extra_state_key(k)}
        return {
            k: pack(v) if is_te_extra_state_key(k) else v
            for k, v in sd.items()
            if k not in self.absent
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = {k: unpack(v) if is_te_extra_state_key(k) else v for k, v in state_dict.items()}
        try:
            result = set_model_state_dict(self.model, sd, options=StateDictOptions(strict=False))
        except RuntimeError as exc:
            if TE_UNSAFE_PICKLE_ENV in str(exc):
                raise UntrustedCheckpointError(str(exc).splitlines()[-1]) from exc
            raise
        allowed = (
            self.absent
            if self.legacy
            else {k for k in result.missing_keys if is_te_extra_state_key(k)}
        )
        wrong = sorted(set(result.missing_keys) - allowed) + list(result.unexpected_keys)
        if wrong:
            raise RuntimeError(f"model state dict mismatch on load: {wrong[:5]}")


#: DCP key prefix of the FP8 scaling item.
FP8_PREFIX = "fp8_scaling."


class Fp8ScalingItem:
    """TE's delayed-scaling FP8 state as plain tensors (te_state.fp8_scaling_state): per module
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
            return fp8_scaling_state(self.model)
        return {
            k: torch.empty(meta.size, dtype=meta.properties.dtype) for k, meta in self.saved.items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)


class OptimizerItem:
    """Optimizer state keyed by parameter FQN, so it reshards like the model."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class PerRankSave:
    """This rank's value of a per-rank item, packed, under key `rank{r}` (only this rank's key:
    the other ranks write theirs)."""

    def __init__(self, get: Callable[[], Any], rank: int) -> None:
        self.get, self.rank = get, rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": pack(self.get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("PerRankSave is for saving only")


class PerRankLoad:
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
        self.values = {r: unpack(state_dict[f"rank{r}"]) for r in self.ranks}


class ProgressItem:
    def __init__(self, train_state: TrainState) -> None:
        self.train_state = train_state

    def state_dict(self) -> dict[str, Any]:
        config = json.dumps(self.train_state.config, sort_keys=True, default=str)
        return {"step": self.train_state.step, "config": config}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_state.step = int(state_dict["step"])
        self.train_state.saved_config = json.loads(state_dict["config"])


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

    def items(self, per_rank: Mapping[str, PerRankLoad] | None = None) -> dict[str, Any]:
        """The DCP state dict: for a save (`per_rank=None`) this rank's per-rank values; for a
        load, the given per-rank load targets."""
        out: dict[str, Any] = {"model": ModelItem(self.model), "progress": ProgressItem(self)}
        fp8 = Fp8ScalingItem(self.model)
        if per_rank is None and fp8.state_dict():
            out["fp8_scaling"] = fp8
        if self.optimizer is not None:
            out["optimizer"] = OptimizerItem(self.model, self.optimizer)
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        if per_rank is None:
            rank = current_rank()
            for name, (get, _put) in self.per_rank_getters().items():
                out[name] = PerRankSave(get, rank)
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


def restore_fp8_scaling(path: Path, state: TrainState, tensors: dict[str, torch.Tensor]) -> None:
    """Hand saved delayed-scaling state to the TE modules, or say why it is not used."""
    recipe = state.fp8_recipe
    saved = next(
        (decode_recipe_identity(v) for k, v in tensors.items() if k.endswith("recipe")),
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
    restored = load_fp8_scaling_state(state.model, tensors, recipe)
    now = recipe_identity(recipe)
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    log.info(
        "FP8 scaling state of %d TE modules restored from %s%s",
        len(restored),
        path,
        f" (recipe changed since the save: {changed})" if changed else "",
    )
