"""The Checkpointer and what it saves: save (sync or async), atomic publish, keep-last-k, load;
`TrainState` and the Stateful items DCP saves and loads.

Every rank writes into `.tmp-step_N`; when the save has finished everywhere and each rank has
summed its files, rank 0 writes the marker and renames the directory to `step_N` (one atomic
rename), then prunes (manifest.publish). A load restores everything on the same world size; on
another one DCP reshards model and optimizer and the per-rank items are reseeded or handed to a
hook; a checkpoint of the other parameter layout is converted (layout.load_converted).

Each item has ``state_dict()`` / ``load_state_dict()`` so DCP can save and load the whole state
as one dict. Per-rank values (data position, RNG) are packed into bytes under per-rank keys,
because DCP keeps only one copy of a non-tensor value that several ranks write under the same
key (torch/distributed/checkpoint/_dedup_save_plans.py).
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
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

from model_utils.checkpoint.layout import (
    load_converted,
    other_layout,
    plain_tensor,
    refuse_low_bit_reshard,
    saved_tensors,
)
from model_utils.checkpoint.manifest import (
    CHECKPOINT_FORMAT,
    PACKED_GLOBALS,
    CheckpointWriteError,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    load,
    loadable_marker,
    own_file_sums,
    publish,
    read_metadata,
    remove_stale_temporaries,
    save_paths,
    write_error_reason,
)
from model_utils.model.te_support import is_te_extra_state_key
from model_utils.parallel.distributed import (
    all_gather_object,
    any_rank,
    barrier,
    current_rank,
    world_size,
)
from model_utils.precision import master_weights
from model_utils.precision.te_state import fp8_scaling_state, load_fp8_scaling_state

log = logging.getLogger(__name__)


def pack(obj: Any) -> bytes:
    """Serialise to bytes so DCP stores `obj` as one opaque object (not traversed for tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(blob: bytes) -> Any:
    """A packed value read back by torch's weights-only unpickler: it runs nothing."""
    with torch.serialization.safe_globals(PACKED_GLOBALS):
        return torch.load(io.BytesIO(blob), weights_only=True)


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

    TE modules' ``_extra_state`` (their FP8 metadata, which TE pickles) is left out: the FP8
    scaling state travels as plain tensors in :class:`Fp8ScalingItem`, and a model's
    extra-state keys are the only ones a load may leave missing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        sd = {k: plain_tensor(v) for k, v in get_model_state_dict(self.model).items()}
        return {k: v for k, v in sd.items() if not is_te_extra_state_key(k)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(strict=False)
        result = set_model_state_dict(self.model, state_dict, options=options)
        allowed = {k for k in result.missing_keys if is_te_extra_state_key(k)}
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


class PerRankItem:
    """A per-rank value under key `rank{r}`. To save (`get` given): this rank's value, packed,
    under this rank's key only (the other ranks write theirs). To load: the values saved by
    ranks `ranks`, read into `self.values` (rank -> unpacked value).

    Ranks may ask for different keys: DCP's default load planner plans every rank locally and
    runs the same collectives whatever the keys (default_planner.create_default_global_load_plan
    is the identity), so a same-world-size load reads only this rank's entry.
    """

    def __init__(self, ranks: Iterable[int], get: Callable[[], Any] | None = None) -> None:
        self.ranks, self.get = list(ranks), get
        self.values: dict[int, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{r}": pack(self.get()) if self.get else b"" for r in self.ranks}

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
class Seen:
    """What the run has trained on so far, over every launch: samples, tokens and the wall-clock
    seconds of its launches (from their first step). Kept in checkpoint.json, so it carries on
    across resumes, batch and world-size changes: runs of other batch sizes compare on it."""

    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @classmethod
    def from_marker(cls, marker: Mapping[str, Any]) -> Seen:
        """The marker's counts; for a checkpoint saved before they were kept, its step times
        the global batch it recorded (exact unless the batch changed on an earlier resume)."""
        if isinstance(marker.get("seen"), dict):
            seen = marker["seen"]
            return cls(int(seen["samples"]), int(seen["tokens"]), float(seen["seconds"]))
        flags, step = marker.get("run_config") or {}, int(marker["step"])
        per_step = int(flags.get("train_batch_size") or 0) * int(flags.get("grad_accum_steps") or 1)
        samples = step * per_step * int(marker.get("world_size") or 1)
        return cls(samples, samples * int(flags.get("max_context_width") or 0), 0.0)


@dataclass
class TrainState:
    """Everything a resumed run needs. `step` is the number of optimizer steps done.

    data: any object with state_dict()/load_state_dict() holding THIS rank's stream position,
    and restart_after_reshard(saved_states) for a checkpoint of another number of ranks
    (saved_states[r]: what rank r saved), which returns what it did, in words for the log.
    config: the run's flags (json-able; non-json values are stored as str).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    data: Any | None = None
    config: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    saved_config: dict[str, Any] | None = None
    # The TE recipe the model runs (None: no TE FP8); saved FP8 scaling state is restored into
    # the TE modules only when it is a delayed-scaling recipe, the one kind that keeps state.
    fp8_recipe: Any = None
    seen: Seen = field(default_factory=Seen)

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

    def items(self, per_rank: Mapping[str, PerRankItem] | None = None) -> dict[str, Any]:
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
                out[name] = PerRankItem([rank], get)
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
    """Hand saved delayed-scaling state to the TE modules that keep such state in this run."""
    recipe = state.fp8_recipe
    restored = load_fp8_scaling_state(state.model, tensors, recipe) if recipe else []
    keeps_none = f": this run ({type(recipe).__name__ if recipe else 'no TE FP8'}) keeps none"
    log.info(
        "FP8 scaling state of %d TE modules restored from %s%s",
        len(restored),
        path,
        "" if restored else keeps_none,
    )


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    marker: dict[str, Any]
    future: Future | None
    started: float
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
        self,
        checkpoint_dir: str | Path,
        keep_last: int | None = None,
        async_save: bool = False,
        state_dict_adapter: Any = None,
    ) -> None:
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep_last = keep_last or None
        self.async_save = async_save
        #: Converts a checkpoint of the other parameter layout on load (te_llama's
        #: StateDictAdapter for the model's config); None: such a checkpoint is refused.
        self.state_dict_adapter = state_dict_adapter
        self._pending: _Pending | None = None
        self._last_saved_step: int | None = None
        self._async_group = None
        if async_save and dist.is_initialized():
            # A second group so the background thread's collectives never interleave with the
            # training loop's on the default group (and async save needs a CPU backend).
            self._async_group = dist.new_group(backend="gloo")
        remove_stale_temporaries(self.checkpoint_dir)

    def remove_all(self) -> None:
        """--overwrite_output_dir: delete an earlier run's published checkpoints before this run
        saves any (all ranks call; rank 0 deletes). Without it, the old run's newer steps would
        outlive pruning and a later `auto` resume would pick them."""
        if current_rank() == 0:
            old = complete_checkpoints(self.checkpoint_dir)
            for path in old:
                shutil.rmtree(path)
            if old:
                log.info(
                    "Deleted %d checkpoint(s) of an earlier run in %s (--overwrite_output_dir)",
                    len(old),
                    self.checkpoint_dir,
                )
        barrier()

    def latest(self) -> Path | None:
        """Newest complete checkpoint in checkpoint_dir, None if there is none: the one messages
        name as kept. The one a resume takes is manifest.checkpoint_to_resume's."""
        return latest_checkpoint(self.checkpoint_dir)

    # -- save
    def save(self, step: int, state: TrainState, block: bool = False) -> Path:
        """Write `state` as checkpoint `step` (all ranks call). Returns the published path (for an
        async save, the path it will have). block=True waits for an async save to publish."""
        self.wait()
        tmp, final = save_paths(self.checkpoint_dir, step)
        if self._last_saved_step == step and is_complete(final):
            return final  # e.g. a preemption save right after the periodic one
        self._last_saved_step = step
        remove_stale_temporaries(self.checkpoint_dir)
        if current_rank() == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        state.step = step
        items = state.items()
        marker = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "world_size": world_size(),
            "items": sorted(items),
            "run_config": state.config,
            "seen": asdict(state.seen),
            "model_config": state.model_config(),
            "torch": torch.__version__,
        }
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
        every rank's sums (a collective on `group`), and rank 0 publishes them in the marker.
        Never raises: the outcome goes to `pending.error`, raised by wait() on every rank."""
        try:
            if failure is not None:
                raise failure
            report: dict[str, Any] = {"files": own_file_sums(pending.tmp)}
        except (Exception, CheckpointException) as exc:
            report = {"error": write_error_reason(exc, self.checkpoint_dir)}
        try:
            reports = all_gather_object(report, group)
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                pending.error = CheckpointWriteError(errors[0])
            elif current_rank() == 0:
                sums = {name: sum_ for r in reports for name, sum_ in r["files"].items()}
                pending.marker["files"] = dict(sorted(sums.items()))
                publish(pending.tmp, pending.final, pending.marker, self.keep_last, pending.started)
        except Exception as exc:  # e.g. the marker or the rename failed on rank 0
            pending.error = CheckpointWriteError(write_error_reason(exc, self.checkpoint_dir))
        finally:
            pending.sealed.set()

    def wait(self) -> None:
        """Finish the pending save (all ranks call): wait until it is sealed (published on rank
        0), then raise its error on every rank if any rank had one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.exception()  # done; the outcome is reported by _seal
        pending.sealed.wait()
        if any_rank(pending.error is not None):
            if current_rank() == 0 and pending.tmp.exists():
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

    # -- load
    def load(self, path: str | Path, state: TrainState) -> LoadResult:
        """Restore `state` from checkpoint `path` (all ranks call); `state.step` is updated.

        Same world size: everything is restored exactly. Different world size: model, optimizer,
        scheduler and step are restored (DCP reshards); RNGs are reseeded from (seed, step, rank);
        the data stream gets `state.data.restart_after_reshard(saved_states)` with every saved
        rank's data state (index = saved rank).

        Another parameter layout (--model_impl hf or te_linear <-> te): weights and AdamW moments
        are converted through `state_dict_adapter` (`load_converted`); step, LR schedule, data and
        RNG load as usual. TE's FP8 metadata, converted or missing (hf -> te_linear), starts fresh.
        """
        marker = loadable_marker(path)
        path = Path(path)
        metadata = read_metadata(path)
        saved_layout = other_layout(metadata, state.model)
        convert = saved_layout is not None
        saved_world_size = int(marker["world_size"])
        resharded = saved_world_size != world_size()
        targets = self._per_rank_targets(path, state, marker, resharded)
        items = state.items(targets)
        if resharded and not convert and "optimizer" in items:
            refuse_low_bit_reshard(path, metadata, state, saved_world_size)
        if convert:
            del items["model"]
            items.pop("optimizer", None)
        else:
            saved_fp8 = {k: md for k, (_, md) in saved_tensors(metadata, FP8_PREFIX).items()}
            if saved_fp8:
                items["fp8_scaling"] = Fp8ScalingItem(state.model, saved_fp8)
        load(items, path)
        if convert:
            saved_impl = (marker.get("run_config") or {}).get("model_impl", "?")
            load_converted(path, metadata, state, saved_layout, self.state_dict_adapter, saved_impl)
        if "fp8_scaling" in items:
            restore_fp8_scaling(path, state, items["fp8_scaling"].loaded)
        if state.optimizer is not None:  # FP8 parameters: the bytes the last step wrote
            master_weights.requantize_from_masters(state.optimizer)
        self._restore_per_rank(state, targets, saved_world_size)
        state.seen = Seen.from_marker(marker)
        saved_config = state.saved_config or {}
        if path.resolve().parent == Path(self.checkpoint_dir).resolve() and not resharded:
            # This run's own checkpoint, loaded as saved: a run with nothing left to train (a
            # finished run resumed to --export_hf) does not write it again.
            self._last_saved_step = state.step if not convert else None
        return LoadResult(path, state.step, saved_world_size, resharded, saved_config, saved_layout)

    @staticmethod
    def _per_rank_targets(
        path: Path, state: TrainState, marker: Mapping[str, Any], resharded: bool
    ) -> dict[str, PerRankItem]:
        """Load targets for the per-rank items the checkpoint holds (warns about missing ones):
        this rank's own entry on a same-size load; on a resharded one every saved data entry
        (handed to the reshard hook) and no RNG entry (reseeded instead)."""
        getters = state.per_rank_getters()
        available = set(marker.get("items", getters))
        if set(getters) - available:
            log.warning("Checkpoint %s has no %s state", path, sorted(set(getters) - available))
        if resharded:
            reads = {"data": list(range(int(marker["world_size"])))}
        else:
            reads = {name: [current_rank()] for name in getters}
        return {n: PerRankItem(r) for n, r in reads.items() if n in getters and n in available}

    @staticmethod
    def _restore_per_rank(
        state: TrainState, targets: dict[str, PerRankItem], saved_world_size: int
    ) -> None:
        """Hand each rank its own saved data position and RNG. After a reshard the RNGs do not
        map onto the new ranks and are reseeded; the data stream gets every rank's position."""
        if saved_world_size == world_size():
            getters = state.per_rank_getters()
            for name, target in targets.items():
                getters[name][1](target.values[current_rank()])
            return
        reseed_rng(derived_seed(state.seed, state.step, current_rank()))
        data = targets.get("data")
        if state.data is None or data is None:
            action = "data stream is left as is (nothing saved or nothing to restore)"
        else:
            action = state.data.restart_after_reshard([data.values[r] for r in data.ranks])
        log.warning(
            "Checkpoint written by %d ranks, loaded on %d: model and optimizer resharded; the "
            "RNG states do not map onto the new ranks and are reseeded from (seed, step=%d, "
            "rank); the %s",
            saved_world_size,
            world_size(),
            state.step,
            action,
        )
