"""Experiment trackers (``--tracker wandb,mlflow,tensorboard``): what metrics.jsonl holds, sent
from rank 0 at report steps, beside the JSONL file (which stays the record of truth): each is a
sink of the same records (write one, close at the end): a class here, named by its row of
config.options.TRACKERS. An A/B's comparison (its record's kind: ``compare``) is a run of the
same sinks: analysis/compare_trackers.py publishes its picture and verdict to them.

A run keeps its tracker run ids in ``<output_dir>/trackers.json``: a resume (Ctrl-C, preemption,
a Slurm requeue) continues the same W&B run and the same MLflow run, never a second one. Each run
is tagged with its precision label, so the fp8 and bf16 twins of an A/B are two runs of one
W&B project / MLflow experiment, side by side in the tracker's own compare view.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import queue
import re
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from model_utils.config.options import TRACKERS
from model_utils.config.sections import precision_name
from model_utils.errors import first_line, write_whole
from model_utils.report.metrics.records import is_number, set_aside

log = logging.getLogger("train")

#: The W&B project / MLflow experiment when the environment names none: both A/B twins land here.
DEFAULT_PROJECT = "fp8-llama"
IDS_FILE = "trackers.json"


#: Not scalars worth a chart: the x axis, the wall-clock stamp (each tracker's own time axis).
_NOT_SCALARS = frozenset({"kind", "step", "time"})


#: The user:password part of a URL (``http://user:pw@host``), which MLFLOW_TRACKING_URI may hold.
_CREDENTIALS = re.compile(r"(\w+://)[^/\s@]+@")


def redacted(text: str) -> str:
    """`text` with every URL's user:password replaced by ***: a log must never show them."""
    return _CREDENTIALS.sub(r"\1***@", text)


def scalars(record: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(tag, value)`` for every number of a train, validation or FP8 numerics record,
    tagged by its kind (``train/loss``, ``val/val_loss``, ``numerics/grad_underflow_pct_max``):
    one chart per metric, nothing picked by hand, so a metric added to the JSONL shows up in
    every tracker too. None (e.g. MFU on CPU) is skipped."""
    kind = record.get("kind")
    if kind not in ("train", "val", "numerics", "compare"):
        return []
    return [
        (f"{kind}/{key}", float(value))
        for key, value in record.items()
        if key not in _NOT_SCALARS and is_number(value)
    ]


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's numbers by tag (``train/loss``)."""
    return dict(scalars(record))


def run_tags(run: Mapping[str, Any]) -> dict[str, str]:
    """What finds a run among a project's: a training run's precision (fp8, bf16 or fp32: the
    tag that splits an A/B's twins), the A/B's comparison's kind (``compare``)."""
    if run.get("kind") == "compare":
        return {"kind": "compare"}
    flags = run.get("flags", {})
    return {"precision": precision_name(bool(flags.get("fp8")), bool(flags.get("bf16")))}


def run_params(run: Mapping[str, Any], fields: tuple[str, ...] = ("world_size",)) -> dict:
    """What a tracker files a run under: its flags and, where the record has them, `fields`."""
    return {**run.get("flags", {}), **{key: run[key] for key in fields if key in run}}


def read_ids(output_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The tracker run ids an earlier segment of this run kept ({} when none). A file that is
    there but cannot be read, or is not a table of ids, is one W line: the resume starts new
    tracker runs, and the user should know why."""
    path = Path(output_dir) / IDS_FILE
    problem = "not a table of tracker names and run ids"
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        ids, problem = None, first_line(exc)
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
    write_whole(Path(output_dir) / IDS_FILE, json.dumps(dict(ids), indent=1) + "\n")


class Sink(Protocol):
    """Where a run's records go besides metrics.jsonl: write a record, close at the end; a
    comparison's run also publishes the A/B's picture, report and verdict."""

    name: str
    id: str | None  # the run id a resume continues (trackers.json), None for none

    def write(self, record: Mapping[str, Any]) -> None: ...

    def publish(self, picture: Path, report: str, verdict: str, step: int) -> None: ...

    def close(self) -> None: ...


class WandbTracker:
    """A W&B run. Offline (``WANDB_MODE=offline``, synced later with ``wandb sync``) unless the
    environment sets WANDB_MODE or holds a WANDB_API_KEY: a compute node without internet must
    not wait on a login. Files go to ``<output_dir>/wandb``."""

    name = "wandb"

    def __init__(
        self, run: Mapping[str, Any], output_dir: str, run_id: str | None, start_step: int = 0
    ) -> None:
        import wandb

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
            tags=list(run_tags(run).values()),
            config={**run_params(run), "output_dir": str(Path(output_dir).resolve())},
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.id = self.run.id
        if mode == "offline" and not os.environ.get("WANDB_MODE"):  # `wandb login` is not read
            log.info("wandb: offline, no WANDB_API_KEY (WANDB_MODE=online uses `wandb login`'s)")

    def write(self, record: Mapping[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=int(record["step"]))

    def publish(self, picture: Path, report: str, verdict: str, step: int) -> None:
        """An A/B's picture and report as media panels at its last step; the verdict in the
        run's summary (a column of the runs table)."""
        import wandb

        report_html = wandb.Html(f"<pre>{html.escape(report)}</pre>")
        media = {"compare/picture": wandb.Image(str(picture)), "compare/report": report_html}
        self.run.log(media, step=step)
        self.run.summary["verdict"] = verdict

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in MLFLOW_TRACKING_URI (a server, or a local store) or, when unset, in
    ``<output_dir>/../mlflow.db`` (SQLite), which the A/B twins under one runs/ folder share.
    The experiment is MLFLOW_EXPERIMENT_NAME or fp8-llama; the run's precision is its tag."""

    name = "mlflow"

    def __init__(
        self, run: Mapping[str, Any], output_dir: str, run_id: str | None, start_step: int = 0
    ) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # an answer in seconds
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        home = Path(output_dir).resolve().parent
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}"
        if _CREDENTIALS.search(uri):  # MLflow's "View run at: URL" banner would print them
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self.client = MlflowClient(tracking_uri=uri)
        if run_id and self._continues(run_id, redacted(uri)):
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
        found = self.client.get_experiment_by_name(name)
        # The default store's artifacts (compare_runs' picture) beside it, not in ./mlruns.
        where = None if os.environ.get("MLFLOW_TRACKING_URI") else (home / "mlartifacts").as_uri()
        create = self.client.create_experiment
        experiment = found.experiment_id if found else create(name, artifact_location=where)
        tags = {**run_tags(run), "output_dir": str(Path(output_dir).resolve())}
        self.id = self.client.create_run(
            experiment, run_name=Path(output_dir).name, tags=tags
        ).info.run_id
        batch = [Param(k, str(v)[:6000]) for k, v in run_params(run).items()]
        for start in range(0, len(batch), 100):  # the server's limit per request
            self.client.log_batch(self.id, params=batch[start : start + 100])

    def _continues(self, run_id: str, uri: str) -> bool:
        """Whether the store holds the run a resume continues (marked running again); a store
        without it (another MLFLOW_TRACKING_URI, a deleted run) gets a new run, said once."""
        from mlflow.exceptions import MlflowException

        try:
            self.id = self.client.get_run(run_id).info.run_id
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("mlflow: run %s is not in %s (another store?): a new run", run_id, uri)
            return False
        self.client.update_run(self.id, status="RUNNING")
        return True

    def write(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(record.get("time", time.time()) * 1000)
        # MLflow keys take no ':' etc.; the tags are letters, digits, '_' and '/'.
        metrics = [Metric(key, value, stamp, int(record["step"])) for key, value in scalars(record)]
        if metrics:
            self.client.log_batch(self.id, metrics=metrics)

    def publish(self, picture: Path, report: str, verdict: str, step: int) -> None:
        """An A/B's picture and report as artifacts, the verdict as its tag and as the run's
        description (MLflow's note)."""
        self.client.log_artifact(self.id, str(picture))
        self.client.log_text(self.id, report, "compare_runs.txt")
        self.client.set_tag(self.id, "verdict", verdict[:5000])  # a server's tag limit
        note = f"{verdict}\n\nThe picture: {picture.name}; the report: compare_runs.txt"
        self.client.set_tag(self.id, "mlflow.note.content", note[:5000])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def flags_markdown(run: Mapping[str, Any]) -> str:
    """The run record as a two-column Markdown table (TensorBoard's text tab renders Markdown),
    so a chart can be traced back to the exact flags that produced it."""
    shown = run_params(run, ("world_size", "samples_per_step"))
    rows = [f"| {key} | {str(value).replace('|', '/')} |" for key, value in shown.items()]
    return "\n".join(["| flag | value |", "|---|---|", *rows])


def _quiet_writer_thread_errors() -> None:
    """TensorBoard's writer thread dies of a full disk with a traceback on stderr, and the next
    write gets the same OSError, which the trackers turn into one warning: leave the thread's
    copy unprinted (every other thread's error is printed)."""
    hook = threading.excepthook
    if getattr(hook, "quiets_tensorboard", False):
        return

    def excepthook(args: threading.ExceptHookArgs) -> None:
        writer_thread = type(args.thread).__module__.startswith("tensorboard.")
        if not (writer_thread and issubclass(args.exc_type, OSError)):
            hook(args)

    excepthook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = excepthook


class TensorBoardTracker:
    """``torch.utils.tensorboard.SummaryWriter``: events in ``<output_dir>/tensorboard``, so
    ``tensorboard --logdir runs`` shows every run, as torchtitan and NeMo users watch them.

    A resume (``start_step``: its checkpoint's step) drops the events after it that the
    interrupted run wrote (``purge_step``): the charts show one line, not twice the steps between
    the last checkpoint and the interruption. A fresh run moves an earlier run's events to
    ``tensorboard.N`` (a run of its own in ``tensorboard --logdir``)."""

    name = "tensorboard"
    id = None  # nothing for a resume to continue: the events folder is the run's

    def __init__(
        self, run: Mapping[str, Any], output_dir: str, run_id: str | None, start_step: int = 0
    ) -> None:
        # Imported here: only runs that ask for TensorBoard need it importable.
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_thread_errors()
        self.log_dir = f"{output_dir}/tensorboard"
        aside = None if start_step else set_aside(self.log_dir)
        if aside is not None:  # a fresh run: its own chart, the earlier one beside it
            log.info("An earlier run's TensorBoard events here are kept in %s", aside)
        log.info(
            "TensorBoard events go to %s; to watch them: %s -m tensorboard.main --logdir %s "
            "(then open http://localhost:6006)",
            self.log_dir,
            sys.executable,  # the Python this run has, with tensorboard installed
            Path(self.log_dir).parent,
        )
        self.writer: Any = SummaryWriter(
            log_dir=self.log_dir,
            purge_step=start_step + 1 if start_step else None,
            flush_secs=30,
        )
        self.writer.add_text("flags", flags_markdown(run), global_step=0)

    def write(self, record: Mapping[str, Any]) -> None:
        for tag, value in scalars(record):  # a NaN loss is kept: TensorBoard shows it
            self.writer.add_scalar(tag, value, record["step"], walltime=record.get("time"))
        self.writer.flush()  # at every report, like the JSONL: a preempted run loses no events

    def publish(self, picture: Path, report: str, verdict: str, step: int) -> None:
        """An A/B's picture on the Images tab, its verdict and report on the Text tab."""
        from matplotlib.image import imread

        self.writer.add_image("compare/picture", imread(picture), step, dataformats="HWC")
        self.writer.add_text("compare/verdict", verdict.replace("\n", "\n\n"), step)
        # A Markdown code block (the Text tab renders Markdown): the table stays in columns.
        self.writer.add_text("compare/report", textwrap.indent(report, "    "), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


#: Each --tracker name -> how its sink opens: ``(run record, output_dir, kept run id, the step a
#: resume starts at (0: a fresh start)) -> Sink``; the class its config.options.TRACKERS row names.
SINKS: dict[str, Callable[[Mapping[str, Any], str, str | None, int], Sink]] = {
    row.name: globals()[row.sink] for row in TRACKERS
}

#: The reporting thread's name (the library noise it causes is filtered by it).
THREAD_NAME = "trackers"
#: How long the end of a run waits for the trackers to send what is queued and close.
CLOSE_TIMEOUT_S = 30.0
#: Records held for trackers that are behind (a slow server); later ones reach metrics.jsonl only.
QUEUE_RECORDS = 10_000
_CLOSE = object()


class _ThreadNoise(logging.Filter):
    """urllib3's retry lines from the reporting thread: a server that does not answer is the
    one warning the thread prints, not two retry lines before it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


def _quiet_http_retries() -> None:
    for name in ("urllib3.connectionpool", "urllib3.util.retry"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ThreadNoise) for f in logger.filters):
            logger.addFilter(_ThreadNoise())


class Trackers:
    """The run's sinks beside metrics.jsonl (TensorBoard, W&B, MLflow), on rank 0; nothing
    elsewhere or when none is asked for.

    They start, write and close on a thread of their own: the training loop only queues a
    record, so a server that is slow, never answers or goes away mid-run never stalls a step
    (nor trips --hang_timeout's watchdog). A sink that cannot start or fails is one warning and
    is dropped; the end of the run waits at most ``close_timeout_s`` for them.
    """

    def __init__(
        self,
        names: list[str],
        run: Mapping[str, Any],
        output_dir: str,
        *,
        enabled: bool,
        start_step: int = 0,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        """``start_step`` 0 (a fresh start, or another run in this folder) never continues the
        tracker runs whose ids the folder holds."""
        self.names = [name for name in names if name in SINKS] if enabled else []
        self.close_timeout_s = close_timeout_s
        self.active: list[Sink] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_RECORDS)
        self._behind = False
        self._thread: threading.Thread | None = None
        if self.names:
            _quiet_http_retries()
            self._thread = threading.Thread(
                target=self._serve,
                args=(dict(run), output_dir, start_step),
                name=THREAD_NAME,
                daemon=True,  # a server that never answers must not keep the process alive
            )
            self._thread.start()

    def write(self, record: Mapping[str, Any]) -> None:
        """Queue a record for the sinks; never waits."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(dict(record))
        except queue.Full:
            if not self._behind:
                self._behind = True
                log.warning(
                    "%s are %d records behind (a slow server): records from step %s on reach "
                    "only metrics.jsonl and this log until they catch up",
                    ", ".join(self.names),
                    QUEUE_RECORDS,
                    record.get("step"),
                )

    def close(self) -> None:
        """Send what is queued and close the sinks, waiting at most ``close_timeout_s``."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        while True:
            try:
                self._queue.put_nowait(_CLOSE)
                break
            except queue.Full:  # behind: make room for the end
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
        thread.join(self.close_timeout_s)
        if thread.is_alive():
            log.warning(
                "%s did not finish within %.0f s (%d records not sent; a server that does not "
                "answer): metrics.jsonl and this log carry every figure",
                ", ".join(sink.name for sink in self.active) or ", ".join(self.names),
                self.close_timeout_s,
                max(self._queue.qsize() - 1, 0),
            )

    def _serve(self, run: dict[str, Any], output_dir: str, start_step: int) -> None:
        self._start(run, output_dir, start_step)
        while (record := self._queue.get()) is not _CLOSE:
            for sink in list(self.active):
                self._guarded(sink, lambda s: s.write(record))
            self._behind = self._behind and not self._queue.empty()
        for sink in list(self.active):
            self._guarded(sink, lambda s: s.close())
        self.active = []

    def _start(self, run: dict[str, Any], output_dir: str, start_step: int) -> None:
        ids = read_ids(output_dir) if start_step else {}
        for name in self.names:
            try:
                sink = SINKS[name](run, output_dir, ids.get(name), start_step)
            except Exception as exc:  # the library's own errors: no common base class
                log.warning(
                    "%s cannot start (%s): training goes on without it",
                    name,
                    redacted(first_line(exc)),
                )
                continue
            self.active.append(sink)
            if sink.id is None:  # nothing a resume continues (TensorBoard)
                continue
            continuing = "continuing run" if ids.get(name) == sink.id else "run"
            log.info("%s: %s %s", name, continuing, sink.id)
            ids[name] = sink.id
        if any(sink.id for sink in self.active):
            try:
                write_ids(output_dir, ids)
            except OSError as exc:
                log.warning(
                    "%s cannot be written (%s): a resume starts new tracker runs",
                    Path(output_dir) / IDS_FILE,
                    first_line(exc),
                )

    def _guarded(self, sink: Sink, action: Callable[[Sink], None]) -> None:
        try:
            action(sink)
        except Exception as exc:  # a tracker's failure must never end training
            self.active.remove(sink)
            log.warning(
                "%s failed (%s): no more %s this run; training goes on (metrics.jsonl and "
                "this log carry the same numbers)",
                sink.name,
                redacted(first_line(exc)),
                sink.name,
            )
