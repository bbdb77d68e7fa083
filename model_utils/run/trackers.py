"""Experiment trackers (``--tracker wandb,mlflow,tensorboard``): what metrics.jsonl holds, sent
from rank 0 at report steps, beside the JSONL file (which stays the record of truth).

A run keeps its tracker run ids in ``<output_dir>/trackers.json``: a resume (Ctrl-C, preemption,
a Slurm requeue) continues the same W&B run and the same MLflow run, never a second one. Each run
is tagged with its precision label, so the fp8 and bf16 twins of an A/B are two runs of one
W&B project / MLflow experiment, side by side in the tracker's own compare view.

A tracker that fails mid-run costs one warning and is dropped; training goes on. One that
cannot start (a server that does not answer) is one warning before training.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from model_utils.config.sections import precision_name
from model_utils.errors import first_line
from model_utils.run.tensorboard_log import scalars

log = logging.getLogger("train")

#: The W&B project / MLflow experiment when the environment names none: both A/B twins land here.
DEFAULT_PROJECT = "fp8-llama"
IDS_FILE = "trackers.json"


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """A train or validation record's numbers, keyed as TensorBoard tags them (``train/loss``)."""
    return dict(scalars(record))


def precision_label(flags: Mapping[str, Any]) -> str:
    """fp8, bf16 or fp32: the tag that splits an A/B's twins."""
    return precision_name(bool(flags.get("fp8")), bool(flags.get("bf16")))


def read_ids(output_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The tracker run ids an earlier segment of this run kept ({} when none). A file that is
    there but cannot be read, or is not a table of ids, is one W line: the resume starts new
    tracker runs, and the user should know why."""
    path = Path(output_dir) / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        ids, problem = None, first_line(exc)
    else:
        problem = "not a table of tracker names and run ids"
    if isinstance(ids, dict):
        return {k: v for k, v in ids.items() if isinstance(v, str)}
    log.warning(
        "%s cannot be read (%s): the trackers start new runs instead of continuing this "
        "run's (its earlier runs stay in the trackers under their ids)",
        path,
        problem,
    )
    return {}


def write_ids(output_dir: str | os.PathLike[str], ids: Mapping[str, str]) -> None:
    path = Path(output_dir) / IDS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(ids), indent=1) + "\n")
    tmp.replace(path)


class Tracker(Protocol):
    name: str

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class WandbTracker:
    """A W&B run. Offline (``WANDB_MODE=offline``, synced later with ``wandb sync``) unless the
    environment sets WANDB_MODE or holds a WANDB_API_KEY: a compute node without internet must
    not wait on a login. Files go to ``<output_dir>/wandb``."""

    name = "wandb"

    def __init__(self, run: Mapping[str, Any], output_dir: str, run_id: str | None) -> None:
        import wandb

        flags = run.get("flags", {})
        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            id=run_id or uuid.uuid4().hex[:16],
            resume="allow",
            name=Path(output_dir).name,
            dir=output_dir,
            mode=mode,
            tags=[precision_label(flags)],
            config={**flags, "world_size": run.get("world_size"), "output_dir": output_dir},
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.id = self.run.id

    def write(self, record: Mapping[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in MLFLOW_TRACKING_URI (a server, or a local store) or, when unset, in
    ``<output_dir>/../mlflow.db`` (SQLite), which the A/B twins under one runs/ folder share.
    The experiment is MLFLOW_EXPERIMENT_NAME or fp8-llama; the run's precision is its tag."""

    name = "mlflow"

    def __init__(self, run: Mapping[str, Any], output_dir: str, run_id: str | None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # an answer in seconds
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            f"sqlite:///{Path(output_dir).resolve().parent / 'mlflow.db'}"
        )
        self.client = MlflowClient(tracking_uri=uri)
        flags = run.get("flags", {})
        if run_id:
            self.id = self.client.get_run(run_id).info.run_id
            self.client.update_run(self.id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        tags = {"precision": precision_label(flags), "output_dir": str(Path(output_dir).resolve())}
        self.id = self.client.create_run(
            experiment, run_name=Path(output_dir).name, tags=tags
        ).info.run_id
        from mlflow.entities import Param

        params = {**flags, "world_size": run.get("world_size")}
        batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(batch), 100):  # the server's limit per request
            self.client.log_batch(self.id, params=batch[start : start + 100])

    def write(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        values = numbers(record)
        if not values:
            return
        stamp = int(record.get("time", time.time()) * 1000)
        step = int(record["step"])
        # MLflow keys take no ':' etc.; the tags are letters, digits, '_' and '/'.
        metrics = [Metric(key, value, stamp, step) for key, value in values.items()]
        self.client.log_batch(self.id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.id)


_TRACKERS: dict[str, type] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The W&B and MLflow runs of a run, on rank 0 (TensorBoard keeps its own writer,
    tensorboard_log.py); nothing elsewhere or when none is asked for."""

    def __init__(
        self,
        names: list[str],
        run: Mapping[str, Any],
        output_dir: str,
        *,
        enabled: bool,
        fresh: bool = False,
    ) -> None:
        """``fresh``: a run starting at step 0 (or another run in this folder) never continues
        the tracker runs whose ids the folder holds."""
        self.active: list[Tracker] = []
        if not enabled:
            return
        ids = {} if fresh else read_ids(output_dir)
        for name in names:
            if name not in _TRACKERS:
                continue
            try:
                tracker = _TRACKERS[name](run, output_dir, ids.get(name))
            except Exception as exc:  # the library's own errors: no common base class
                log.warning(
                    "%s cannot start (%s): training goes on without it", name, first_line(exc)
                )
                continue
            if ids.get(name) == tracker.id:
                log.info("%s: continuing run %s", name, tracker.id, stacklevel=3)
            else:
                log.info("%s: run %s", name, tracker.id, stacklevel=3)
            ids[name] = tracker.id
            self.active.append(tracker)
        if self.active:
            try:
                write_ids(output_dir, ids)
            except OSError as exc:
                log.warning(
                    "%s cannot be written (%s): a resume starts new tracker runs",
                    Path(output_dir) / IDS_FILE,
                    first_line(exc),
                )

    def write(self, record: Mapping[str, Any]) -> None:
        for tracker in list(self.active):
            self._guarded(tracker, lambda t: t.write(record))

    def close(self) -> None:
        for tracker in list(self.active):
            self._guarded(tracker, lambda t: t.close())
        self.active = []

    def _guarded(self, tracker: Tracker, action: Any) -> None:
        try:
            action(tracker)
        except Exception as exc:  # a tracker's failure must never end training
            self.active.remove(tracker)
            log.warning(
                "%s failed (%s): no more %s this run; training goes on (metrics.jsonl and "
                "this log carry the same numbers)",
                tracker.name,
                first_line(exc),
                tracker.name,
            )
