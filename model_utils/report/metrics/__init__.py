"""Throughput accounting: FLOPs per token, device peaks, the step meter, log lines, JSONL, summary.

What the numbers mean (kept in one place so docs/metrics.md and the logs agree):
- A *step* is one optimizer step (all gradient-accumulation micro-batches). Figures are per
  *window*: the steps between two log lines, timed by the wall clock between two device syncs
  (see :class:`StepMeter`), so they hold whatever ``--logging_freq`` is. Speed includes data
  loading ("data wait", reported as a share of the window); validation and checkpoint saves are
  left out.
- ``samples`` and ``tokens`` are GLOBAL (all ranks) per step; "per device" figures divide by the
  world size.
- TFLOP/s are *model* FLOPs (see :func:`flops_per_token`), not hardware FLOPs: activation
  recomputation and FP8 casts are not counted. MFU divides them by the device's dense **bf16**
  peak, also for FP8 runs (as torchtitan does), so fp8 and bf16 MFUs are comparable with each
  other but an FP8 run's MFU is not "utilisation of the FP8 peak".

The modules, one job each: `flops` (model FLOPs per token), `device` (bf16 peaks, peak
memory, device sync), `meter` (the step meter and time left), `records` (JSONL records, the
log lines and what a reader checks of them), `summary` (end-of-run medians and comparison
tables). What a run's reporting and the scripts read is re-exported here (`from
model_utils.report import metrics; metrics.StepMeter(...)`); the rest is imported from its module.
"""

from model_utils.report.metrics.device import peak_bf16_tflops, peak_bf16_tflops_for_name
from model_utils.report.metrics.flops import flops_per_token
from model_utils.report.metrics.meter import StepMeter
from model_utils.report.metrics.records import (
    JsonlWriter,
    detail_line,
    format_duration,
    identity_change,
    read_jsonl,
    run_line,
    run_record,
    seed_line,
    validation_record,
)
from model_utils.report.metrics.summary import format_table, summarize
