"""What a run reports: the seed log line, the detail line, metrics.jsonl, TensorBoard, the
validation loss and the end-of-run summary (rank 0 writes; every rank keeps the schedule).

The log calls pass ``stacklevel=2`` so a line names the train.py line that reported it, as the
recipe's log format (``[train.py:N]``) always has.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from model_utils.config import arguments
from model_utils.config.fp8_plan import plan_of
from model_utils.errors import first_line, os_error_words, write_whole
from model_utils.model import modeling
from model_utils.precision import numerics
from model_utils.report import metrics, slow_rank, trackers
from model_utils.report.metrics.device import device_sync, peak_memory_bytes, peak_memory_label
from model_utils.report.metrics.records import first_run_record, set_aside, upstream_validation_line
from model_utils.report.metrics.summary import SPEED_WARMUP_STEPS, format_summary

log = logging.getLogger("train")

#: How the world line names each --sharding_strategy.
SHARDING_WORDS = {"full": "full sharding", "hybrid": "hybrid sharding", "none": "no FSDP2"}
#: The run's resolved flags in its folder, for `train.py @<output_dir>/run.args`.
RUN_ARGS = "run.args"


def evaluate(model, batches, backend, device) -> float:
    """Mean held-out loss over this rank's fixed validation batches, averaged over ranks."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            with backend.autocast():
                loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            total += torch.stack([loss.double(), torch.ones((), device=device).double()])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


class RunLog:
    """Rank 0's view of the run: the start-up lines, the seed log line, the detail line, JSONL
    and the summary.

    Every rank keeps the same report schedule (every --logging_freq steps and the last step):
    the loss all-reduce there is a collective, and the loop checks for preemption at the same
    steps, so the device is never waited for in between.
    """

    def __init__(
        self, config, model, backend, world, device, *, seen, start_step: int = 0, watchdog=None
    ) -> None:
        samples_per_step = (
            config.data.train_batch_size * config.optim.grad_accum_steps * world.world_size
        )
        self.config, self.device, self.samples = config, device, samples_per_step
        self.tokens = samples_per_step * config.model.max_context_width
        # the TrainState's checkpoint.Seen, which its checkpoints save: counted on here
        self.seen = seen
        self.is_main, self.world_size = world.is_main, world.world_size
        self.warmup = min(SPEED_WARMUP_STEPS, config.run.max_steps // 2)
        peak, peak_label = metrics.peak_bf16_tflops(device)  # the MFU basis
        self.meter = metrics.StepMeter(
            metrics.flops_per_token(config.model, config.model.max_context_width),
            world.world_size,
            peak,
            peak_label,
            peak_memory_label(device),
            sync=device_sync(device),
            max_steps=config.run.max_steps,
            warmup_steps=self.warmup,
            elapsed_before=seen.seconds,
        )
        self.watchdog = watchdog  # watchdog.Watchdog: told of every step, paused with the meter
        threshold = config.run.slow_rank_threshold
        self.ranks = slow_rank.RankTimes(world.world_size if threshold else 1, device, threshold)
        self.jsonl_path = f"{config.run.output_dir}/metrics.jsonl"
        run = metrics.run_record(
            config.as_dict(),
            world_size=world.world_size,
            samples_per_step=samples_per_step,
            start_step=start_step,
        )
        other = self._own_records(run, start_step) if self.is_main else None
        self.writer = metrics.JsonlWriter(self.jsonl_path, enabled=self.is_main)
        self.records_lost_from: str | None = None  # where metrics.jsonl stopped, if it did
        args_path = Path(config.run.output_dir) / RUN_ARGS
        log.info(metrics.run_line(self.jsonl_path, args_path), stacklevel=2)
        self._record(run)
        if self.is_main:
            self._save_args()
        self._open_trackers(run, 0 if other else start_step)  # another run's: its own
        self.numerics = self._numerics_probe(model, backend, start_step)
        self.reduce = getattr(model, "grad_reduce_scatter", None)  # FSDP2's: parallel/fp8_reduce.py
        self._say_what_runs(model, backend, world)

    def _say_what_runs(self, model, backend, world) -> None:
        """The start-up lines of the model, its precision and the world (train.py's lines in the
        log: stacklevel 3 names RunLog's caller)."""
        config = self.config
        log.info(
            "model: %s, %.1fM parameters, impl=%s; %s",
            config.model_source,
            modeling.count_parameters(model) / 1e6,
            config.precision.model_impl,
            backend.describe(),
            stacklevel=3,
        )
        log.info(
            "world: %d ranks (%d nodes), %s, %s; global batch %d sequences x %d tokens",
            world.world_size,
            world.num_nodes,
            self.device,
            SHARDING_WORDS[config.parallel.sharding_strategy],
            self.samples,
            config.model.max_context_width,
            stacklevel=3,
        )
        if config.parallel.reduce_dtype == "fp8" and world.world_size == 1:  # FSDP2 only copies
            why = "FSDP2 copies its gradients, none goes through FP8; it acts from 2 ranks on"
            log.warning(
                "--reduce_dtype fp8 reduces nothing in a world of one: %s", why, stacklevel=3
            )

    def _own_records(self, run: dict, start_step: int) -> str | None:
        """metrics.jsonl holds one run: a fresh start, or a launch of another run (another
        identity, metrics.identity_change), moves the file there aside (its run.args and
        profiler traces with it). Returns how the run whose records were there is another run,
        None if it is this one."""
        other = metrics.identity_change(first_run_record(self.jsonl_path), run)
        if start_step == 0 or other:  # its flags and step_breakdown's traces go with them
            why = f"another run's records ({other})" if other else "an earlier run's"
            out = Path(self.config.run.output_dir)
            held = {"metrics.jsonl": why, RUN_ARGS: "its flags", "profile/": "its traces"}
            for name, what in held.items():
                if (aside := set_aside(out / name.rstrip("/"))) is not None:
                    log.info("%s here held %s: kept as %s", name, what, aside, stacklevel=3)
        return other

    def _open_trackers(self, run: dict, start_step: int) -> None:
        """TensorBoard (``--tensorboard`` or ``--tracker tensorboard``), W&B and MLflow: a
        resume continues their runs, a fresh start (or another run's folder) starts new ones."""
        names = self.config.run.tracker.split(",")
        if self.config.run.tensorboard and "tensorboard" not in names:
            names.append("tensorboard")
        self.trackers = trackers.Trackers(
            names, run, self.config.run.output_dir, enabled=self.is_main, start_step=start_step
        )

    def is_report_step(self, step: int) -> bool:
        return step % self.config.run.logging_freq == 0 or step == self.config.run.max_steps

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is not training (validation, a checkpoint save): out of the window's time,
        out of the ranks' busy times, not timed by the hang watchdog."""
        watchdog = self.watchdog.paused() if self.watchdog else contextlib.nullcontext()
        with watchdog, self.meter.paused(), self.ranks.paused():
            yield

    def step(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        data_wait: float,
        grad_norm: torch.Tensor | None = None,
    ) -> None:
        """Count every step; at report steps log the window since the previous report (with
        the report step's gradient norm before clipping: read where the loss is, no other
        sync), and name the slowest rank if it is over --slow_rank_threshold."""
        if self.watchdog:
            self.watchdog.step_done()
        self.meter.add_step(data_wait_seconds=data_wait, samples=self.samples, tokens=self.tokens)
        # over all the run's launches: what a checkpoint saves, so a resume carries on from them
        self.seen.samples += self.samples
        self.seen.tokens += self.tokens
        self.seen.seconds = self.meter.elapsed()
        self.ranks.add_step(data_wait)
        if self.numerics:
            self.numerics.step_done()
        if not self.is_report_step(step):
            self._arm_numerics(self.is_report_step(step + 1))
            return
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        loss_value = loss.item()
        # every rank: one all-gather of two numbers, inside the timed step like the loss's
        # all-reduce (a wait for a slow rank belongs to the step it happened in)
        slow = self.ranks.gather()
        grad_value = None if grad_norm is None else float(grad_norm)  # ready with the loss
        memory = peak_memory_bytes(self.device)
        record = self.meter.report(step=step, loss=loss_value, lr=lr, peak_memory_bytes=memory)
        record.update(grad_norm=grad_value, **self._seen_fields())
        if self.reduce is not None:  # what this rank's gradient reduce-scatters sent a step
            sent, self.reduce.bytes_sent = self.reduce.bytes_sent, 0
            record["grad_reduce_bytes"] = sent // record["window_steps"]
        log.info(metrics.seed_line(step, loss_value, record["samples_per_sec"], lr), stacklevel=2)
        log.info(metrics.detail_line(record), stacklevel=2)
        if slow is not None:
            record.update(slow_rank.record_fields(slow))
            if slow.named and self.is_main:
                line = slow_rank.slow_rank_line(step, record["window_steps"], slow)
                log.warning(line, stacklevel=2)
        if self.watchdog:
            self.watchdog.measured(record["step_seconds"] / record["window_steps"])
        self._record(record)
        self.trackers.write(record)
        self._report_numerics(step)
        self._arm_numerics(self.is_report_step(step + 1))

    def _numerics_probe(self, model, backend, start_step: int):
        """--fp8_numerics: rank 0 measures, armed for the first step if it reports; on TE's fused
        layers TE's debug tools measure, on every rank (the backend started them)."""
        if not plan_of(self.config).numerics:
            return None
        debug = getattr(backend, "debug", None)
        if debug is not None:
            debug.begin(start_step, keep=self.is_main)
            return debug
        if not self.is_main:
            return None
        probe = numerics.Probe(model, backend.te_recipe)
        probe.armed = self.is_report_step(start_step + 1)
        return probe

    def _arm_numerics(self, armed: bool) -> None:
        """Measure during the next step's forward and backward, or not (the report steps do)."""
        if self.numerics:
            self.numerics.armed = armed

    def _report_numerics(self, step: int) -> None:
        """The report step's FP8 figures: a log line, a ``numerics`` record with every layer,
        and the per-role worst values for the trackers."""
        figures = self.numerics.take() if self.numerics else None
        if not figures:
            return
        log.info(numerics.numerics_line(step, figures), stacklevel=3)
        summary = {"kind": "numerics", "step": step, **numerics.summary_fields(figures)}
        self._record({**summary, "layers": figures})
        self.trackers.write(summary)

    def validation(self, step: int, model, batches, backend) -> None:
        armed = self.numerics.armed if self.numerics else False
        with self.paused():
            self._arm_numerics(False)  # held-out batches are not the training step's casts
            start = time.perf_counter()
            val_loss = evaluate(model, batches, backend, self.device)
            seconds = time.perf_counter() - start
            self._arm_numerics(armed)
        every = len(batches) * self.world_size  # the ranks' batches (as many on each rank)
        log.info(
            "Validation at step %d: loss %.5f over %d batches", step, val_loss, every, stacklevel=2
        )
        log.info(upstream_validation_line(step, val_loss), stacklevel=2)
        record = metrics.validation_record(
            step=step, val_loss=val_loss, batches=every, seconds=seconds
        )
        record.update(self._seen_fields())
        self._record(record)
        self.trackers.write(record)

    def validated_at(self, step: int) -> bool:
        """Whether metrics.jsonl holds a validation at `step` (rank 0 reads it; others: False)."""
        with contextlib.suppress(OSError, ValueError):  # unreadable: validate again
            records = metrics.read_jsonl(self.jsonl_path) if self.is_main else []
            return any(r["kind"] == "val" and r.get("step") == step for r in records)
        return False

    def _save_args(self) -> None:
        """<output_dir>/run.args: this run's resolved flags, which `train.py @FILE` runs again
        (written at each launch: a resume's free changes are the run's now)."""
        path = Path(self.config.run.output_dir) / RUN_ARGS
        header = [f"# train.py @{path} [flags that override these]: this run, resolved"]
        try:
            write_whole(path, "\n".join(header + arguments.saved_args(self.config)) + "\n")
        except OSError as exc:
            log.warning("%s cannot be written (%s)", path, os_error_words(exc), stacklevel=4)

    def _seen_fields(self) -> dict[str, int]:
        return {"samples_seen": self.seen.samples, "tokens_seen": self.seen.tokens}

    def _record(self, record: dict) -> None:
        """metrics.jsonl gets the record; if its file system refuses (full, quota), the run goes
        on: losing the checkpoints still to come over a metrics file would be the worse loss,
        and the log lines carry the same figures. One warning, then no more records."""
        try:
            self.writer.write(record)
        except OSError as exc:
            self.writer.close()
            self.records_lost_from = f"step {record['step']}" if "step" in record else "the start"
            log.warning(
                "%s cannot be written (%s): training goes on without it from %s on (the file "
                "keeps only whole records; this log carries every figure); free space in "
                "--output_dir",
                self.jsonl_path,
                os_error_words(exc),
                self.records_lost_from,
                stacklevel=3,
            )

    def close(self) -> None:
        """The records' files and trackers closed (what is queued sent first): at the end of
        every launch, a preempted or failed one too."""
        self.writer.close()
        self.trackers.close()
        if self.numerics:
            self.numerics.close()

    def finish(self) -> None:
        self.close()
        if self.is_main:
            try:  # the file, not memory: a resumed run's summary covers every segment
                records = metrics.read_jsonl(self.jsonl_path)
            except (OSError, ValueError) as exc:  # deleted, or damaged, while the run went on
                log.warning(
                    "No summary: %s cannot be read (%s); this log carries every figure",
                    self.jsonl_path,
                    first_line(exc),
                    stacklevel=2,
                )
                return
            title = "Summary"
            if lost := self.records_lost_from:
                title = f"Summary of what metrics.jsonl kept (it lost the records from {lost} on)"
            text = format_summary(metrics.summarize(records, self.warmup), title)
            slow = slow_rank.summary_line(records)
            log.info("\n" + text + (f"\n{slow}" if slow else ""), stacklevel=2)
