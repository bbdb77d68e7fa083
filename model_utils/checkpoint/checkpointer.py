"""The Checkpointer: save (sync or async), atomic publish, keep-last-k, verified resume, load.

Every rank writes into `.tmp-step_N`; when the save has finished everywhere and each rank has
summed its files, rank 0 writes the marker and renames the directory to `step_N` (one atomic
rename), then prunes. A load restores everything on the same world size; on another one DCP
reshards model and optimizer and the per-rank items are reseeded or handed to a hook; a
checkpoint of the other parameter layout is converted (convert.py).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from model_utils.checkpoint.convert import load_converted, param_layout
from model_utils.checkpoint.errors import (
    CheckpointWriteError,
    ResumeRefused,
    UntrustedCheckpointError,
    untrusted_checkpoint_message,
    write_error_reason,
)
from model_utils.checkpoint.manifest import (
    DAMAGED_PREFIX,
    MARKER,
    TMP_PREFIX,
    checkpoint_damage,
    checkpoint_name,
    checkpoint_problem,
    complete_checkpoints,
    content_damage,
    dir_bytes,
    file_sums,
    fsync_dir,
    is_complete,
    latest_checkpoint,
    no_sound_checkpoint,
    own_files,
    prune_plan,
    read_marker,
    recorded_sums,
    resolve_checkpoint,
    set_aside_all,
    stale_temporaries,
    step_dirs,
    unverified_reason,
    verdict,
    verified_checkpoints,
    write_json,
)
from model_utils.checkpoint.optimizer_state import refuse_low_bit_reshard
from model_utils.checkpoint.ranks import (
    all_gather_object,
    any_rank,
    barrier,
    current_rank,
    world_size,
)
from model_utils.checkpoint.saved import MODEL_PREFIX
from model_utils.checkpoint.stateful import (
    FP8_PREFIX,
    Fp8ScalingItem,
    LoadResult,
    ModelItem,
    PerRankLoad,
    TrainState,
    derived_seed,
    reseed_rng,
    restore_fp8_scaling,
)
from model_utils.model.te_support import is_te_extra_state_key
from model_utils.precision import master_weights

log = logging.getLogger(__name__)

# 2: TE's FP8 scaling state as plain tensors (item fp8_scaling), no pickled _extra_state.
CHECKPOINT_FORMAT = 2


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
        self._publish_lock = threading.Lock()  # rank 0: done-callback thread vs wait()
        self._async_group = None
        if async_save and dist.is_initialized():
            # A second group so the background thread's collectives never interleave with the
            # training loop's on the default group (and async save needs a CPU backend).
            self._async_group = dist.new_group(backend="gloo")
        if current_rank() == 0:
            for stale in stale_temporaries(self.checkpoint_dir):
                shutil.rmtree(stale, ignore_errors=True)

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

    # -- discovery
    def latest(self) -> Path | None:
        """Newest complete checkpoint in checkpoint_dir, None if there is none."""
        return latest_checkpoint(self.checkpoint_dir)

    def verify(self, path: str | Path) -> str | None:
        """Why checkpoint `path` is damaged, or None if intact (all ranks call): the cheap checks,
        then every file's checksum, the files split over the ranks so each is read once."""
        problem = checkpoint_damage(path)
        if problem is None:
            files = sorted(recorded_sums(read_marker(path)).items())
            problem = content_damage(path, dict(files[current_rank() :: world_size()]))
        return next((p for p in all_gather_object(problem) if p), None)

    def resolve_intact(self, resume_from_checkpoint: str | None) -> Path | None:
        """--resume_from_checkpoint, verified (all ranks call): None/'' -> None; PATH -> PATH if
        intact (one without checksums with a warning: it was named), else ResumeRefused naming
        the damaged file; 'auto' -> the newest intact, verified checkpoint, each newer one set
        aside with a warning (damaged: `damaged-`, no checksums: `unverified-`); ResumeRefused
        if there are checkpoints but none of those (None: a fresh start)."""
        if not resume_from_checkpoint:
            return None
        if resume_from_checkpoint != "auto":
            path = resolve_checkpoint(resume_from_checkpoint, self.checkpoint_dir)
            problem = self.verify(path)
            if problem:
                raise ResumeRefused(f"--resume_from_checkpoint {path} is damaged: {problem}")
            if unverified_reason(path) and current_rank() == 0:
                log.warning("Loading %s unverified, as named: %s", path, unverified_reason(path))
            return path
        found = all_gather_object(step_dirs(self.checkpoint_dir))[0]  # rank 0's
        passed = []
        for path in reversed(found):
            passed_by = verdict(path, self.verify(path))
            if passed_by is None:
                set_aside_all(passed, f"resuming from {path}, the newest verified checkpoint")
                return path
            passed.append((path, *passed_by))
        if passed:
            set_aside_all([p for p in passed if p[1] == DAMAGED_PREFIX], "")
            raise ResumeRefused(no_sound_checkpoint(self.checkpoint_dir, passed))
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
        if current_rank() == 0:
            for stale in stale_temporaries(self.checkpoint_dir):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        state.step = step
        marker = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "world_size": world_size(),
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
            reports = all_gather_object(report, group)
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                pending.error = CheckpointWriteError(errors[0])
            elif current_rank() == 0:
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
        write_json(pending.tmp / MARKER, marker)
        replaced = None
        if pending.final.exists() and not is_complete(pending.final):  # damage: kept, named
            set_aside_all([(pending.final, DAMAGED_PREFIX, checkpoint_problem(pending.final))], "")
        if pending.final.exists():  # the same step saved again (e.g. a rerun from older state)
            replaced = pending.final.with_name(f"{TMP_PREFIX}{pending.final.name}.replaced")
            pending.final.rename(replaced)
        pending.tmp.rename(pending.final)
        fsync_dir(pending.final.parent)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        seconds = time.perf_counter() - pending.started
        log.info(
            "Checkpoint step %d saved to %s (%.1f MB, %.2f s)",
            pending.step,
            pending.final,
            dir_bytes(pending.final) / 2**20,
            seconds,
        )
        # The checkpoint just published is intact (its files were just summed), so pruning the
        # others never removes the last intact one.
        for old in prune_plan(
            verified_checkpoints(self.checkpoint_dir), self.keep_last, pending.final
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
        the data stream gets `state.on_data_reshard(step, saved_states)` with every saved rank's
        data state (index = saved rank), or keeps its fresh position if no hook is set.

        Another parameter layout (saved by --model_impl hf or te_linear, loaded by te, or the
        reverse): weights and AdamW moments are converted through `state_dict_adapter` one
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
        saved_layout = param_layout(
            k[len(MODEL_PREFIX) :] for k in saved_keys if k.startswith(MODEL_PREFIX)
        )
        convert = saved_layout != param_layout(model_keys)
        saved_world_size = int(marker["world_size"])
        resharded = saved_world_size != world_size()
        targets = self._per_rank_targets(path, state, marker, resharded, saved_world_size)
        items = state.items(targets)
        if resharded and not convert and "optimizer" in items:
            refuse_low_bit_reshard(path, metadata, state, saved_world_size)
        if convert:
            del items["model"]
            items.pop("optimizer", None)
        else:
            items["model"] = self._model_item(path, state, saved_keys, model_keys)
            saved_fp8 = {
                k[len(FP8_PREFIX) :]: v for k, v in saved_keys.items() if k.startswith(FP8_PREFIX)
            }
            if saved_fp8:
                items["fp8_scaling"] = Fp8ScalingItem(state.model, saved_fp8)
        _dcp_load(items, path)
        if convert:
            saved_impl = (marker.get("run_config") or {}).get("model_impl", "?")
            load_converted(path, metadata, state, saved_layout, self.state_dict_adapter, saved_impl)
        if "fp8_scaling" in items:
            restore_fp8_scaling(path, state, items["fp8_scaling"].loaded)
        if state.optimizer is not None:  # FP8 parameters: the bytes the last step wrote
            master_weights.requantize_from_masters(state.optimizer)
        self._restore_per_rank(state, targets, resharded, saved_world_size)
        converted_from = saved_layout if convert else None
        saved_config = state.saved_config or {}
        if path.resolve().parent == Path(self.checkpoint_dir).resolve() and not resharded:
            # This run's own checkpoint, loaded as saved: a run with nothing left to train (a
            # finished run resumed to --export_hf) does not write it again.
            self._last_saved_step = state.step if not convert else None
        return LoadResult(
            path, state.step, saved_world_size, resharded, saved_config, converted_from
        )

    @staticmethod
    def _per_rank_targets(
        path: Path,
        state: TrainState,
        marker: dict[str, Any],
        resharded: bool,
        saved_world_size: int,
    ) -> dict[str, PerRankLoad]:
        """Load targets for the per-rank items the checkpoint holds (warns about missing ones)."""
        getters = state.per_rank_getters()
        available = set(marker.get("items", getters))
        if set(getters) - available:
            log.warning("Checkpoint %s has no %s state", path, sorted(set(getters) - available))
        reads = {n: _ranks_to_read(n, resharded, saved_world_size) for n in getters}
        return {n: PerRankLoad(r) for n, r in reads.items() if n in available and r}

    def _restore_per_rank(
        self,
        state: TrainState,
        targets: dict[str, PerRankLoad],
        resharded: bool,
        saved_world_size: int,
    ) -> None:
        """Hand each rank its own saved data position and RNG, or after a reshard reseed."""
        if resharded:
            self._after_reshard(state, saved_world_size, targets.get("data"))
            return
        getters = state.per_rank_getters()
        for name, target in targets.items():
            getters[name][1](target.values[current_rank()])

    @staticmethod
    def _model_item(path: Path, state: TrainState, saved_keys, model_keys) -> ModelItem:
        """The model's load target: format 2, or format 1 with TE's pickled extra state."""
        if not any(k.startswith(MODEL_PREFIX) and is_te_extra_state_key(k) for k in saved_keys):
            return ModelItem(state.model)
        absent = [
            k for k in model_keys if is_te_extra_state_key(k) and MODEL_PREFIX + k not in saved_keys
        ]
        if absent:
            log.info(
                "Checkpoint %s has no Transformer Engine extra state for %d modules (saved "
                "without TE modules): their FP8 metadata starts fresh",
                path,
                len(absent),
            )
        return ModelItem(state.model, legacy=True, absent_extra_state=absent)

    @staticmethod
    def _after_reshard(state: TrainState, saved_world_size: int, data: PerRankLoad | None) -> None:
        reseed_rng(derived_seed(state.seed, state.step, current_rank()))
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
            world_size(),
            state.step,
            action,
        )


def _dcp_load(items: dict[str, Any], path: Path) -> None:
    """dcp.load, turning TE's refusal of a pickled format-1 FP8 state into one clear line."""
    try:
        dcp.load(items, checkpoint_id=str(path))
    except UntrustedCheckpointError as exc:
        te = sys.modules.get("transformer_engine")
        version = getattr(te, "__version__", "this release")
        raise UntrustedCheckpointError(untrusted_checkpoint_message(path, version)) from exc


def _ranks_to_read(name: str, resharded: bool, saved_world_size: int) -> list[int]:
    """Own entry on a same-size load; on a resharded load every saved data entry (handed to the
    reshard hook) and no RNG entry (reseeded instead)."""
    if not resharded:
        return [current_rank()]
    return list(range(saved_world_size)) if name == "data" else []
