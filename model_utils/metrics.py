"""Throughput accounting: FLOPs per token, device peaks, the step meter, log lines, JSONL, summary.

What the numbers mean (kept in one place so the README and the logs agree):
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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = float(1 << 30)

# ---------------------------------------------------------------------------------------------
# FLOPs per token


def matmul_params(
    *,
    hidden: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
    vocab: int,
) -> int:
    """Weights that take part in a matrix multiply for every token (Llama, no biases).

    Per decoder layer: q ``h*(n_heads*d)``, k and v ``h*(n_kv*d)`` each, o ``(n_heads*d)*h``,
    gate/up/down ``3*h*intermediate``; plus ``lm_head`` ``h*vocab``. The input embedding is a
    table lookup, not a matmul, so it is excluded; norms (vectors) are excluded. ``lm_head`` is
    counted whether or not it is tied to the embedding: the matmul runs either way.
    """
    if num_heads <= 0 or hidden % num_heads:
        raise ValueError(
            f"hidden ({hidden}) must be a positive multiple of num_heads ({num_heads})"
        )
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    head_dim = hidden // num_heads
    attention = hidden * num_heads * head_dim * 2 + hidden * num_kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    return num_layers * (attention + mlp) + hidden * vocab


def flops_per_token(
    *,
    hidden: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
    vocab: int,
    seq_len: int,
) -> float:
    """Training FLOPs per token = ``6 * N + 12 * L * n_heads * head_dim * seq_len``.

    - ``6 * N``: a matmul with N weights costs ``2N`` FLOPs per token forward and ``4N`` backward
      (grad of input and grad of weight). N is :func:`matmul_params`: every projection, the MLP
      and ``lm_head``; not the input embedding.
    - ``12 * L * n_heads * head_dim * seq_len``: per layer and token, ``Q @ K^T`` and
      ``softmax @ V`` cost ``2 * seq_len * head_dim`` each per query head forward, times 3 for
      forward + backward. Query heads, not KV heads: GQA shares K/V but computes every score.
      The causal mask is NOT discounted (the full ``seq x seq`` product is counted, as in
      torchtitan/PaLM), so a causal flash kernel does about half this attention work.
    - Not counted: norms, RoPE, SiLU, softmax, the loss, optimizer, and activation recompute.
    Tied embeddings would not change the result: the ``lm_head`` matmul costs the same whether
    its weight is shared (the tied case is counted in tests/test_metrics.py).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    n = matmul_params(
        hidden=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate=intermediate,
        vocab=vocab,
    )
    head_dim = hidden // num_heads
    return float(6 * n + 12 * num_layers * num_heads * head_dim * seq_len)


def model_flops_per_token(config: Any, seq_len: int) -> float:
    """:func:`flops_per_token` for a transformers ``LlamaConfig`` (what train.py builds)."""
    return flops_per_token(
        hidden=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        seq_len=seq_len,
    )


# ---------------------------------------------------------------------------------------------
# Device peaks and memory

# Dense (no sparsity) BF16 tensor-core peaks in TFLOP/s from NVIDIA datasheets, the same values
# torchtitan uses. Order matters: the first substring found in the device name wins.
_BF16_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 NVL", 835.0, "H100 NVL"),
    ("H100 PCIe", 756.0, "H100 PCIe"),
    ("H100", 989.0, "H100 SXM"),
    ("H200", 989.0, "H200"),
    ("A100", 312.0, "A100"),
    ("B200", 2250.0, "B200"),
)


def peak_bf16_tflops_for_name(device_name: str) -> tuple[float | None, str]:
    """Dense bf16 peak for a CUDA device name (e.g. ``"NVIDIA H100 80GB HBM3"``) and a label."""
    for needle, tflops, label in _BF16_PEAKS:
        if needle.lower() in device_name.lower():
            return tflops, f"vs {label} dense bf16 peak {tflops:g} TFLOP/s"
    return None, f"n/a: no bf16 peak known for {device_name!r}"


def peak_bf16_tflops(device: torch.device | str) -> tuple[float | None, str]:
    """``(peak TFLOP/s or None, label)``. None on CPU and on GPUs missing from the table."""
    device = torch.device(device)
    if device.type == "cuda":
        return peak_bf16_tflops_for_name(torch.cuda.get_device_name(device))
    return None, f"n/a on {device.type}"


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory so far: CUDA ``max_memory_allocated`` on GPU, process max RSS elsewhere.

    The two are different quantities (tensor allocations vs the whole process, including
    Python, libraries and the data pipeline); :func:`peak_memory_label` says which one it is.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)


def peak_memory_label(device: torch.device | str) -> str:
    device = torch.device(device)
    return "cuda max allocated" if device.type == "cuda" else "process max RSS"


# ---------------------------------------------------------------------------------------------
# The step meter


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for every kernel queued on ``device`` (a no-op on CPU, where work
    runs as it is issued). The step meter calls it at the two ends of every timed window."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def step_metrics(
    *,
    step: int,
    loss: float,
    lr: float,
    step_seconds: float,
    data_wait_seconds: float,
    samples: int,
    tokens: int,
    world_size: int,
    peak_memory_bytes: int,
    flops_per_token: float,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Throughput metrics of one step (or of a window of steps: pass the window sums).

    ``samples``/``tokens`` are global; ``step_seconds`` is the whole step including data wait.
    ``mfu`` is a percentage of ``peak_tflops`` (bf16 dense) or None when no peak is known.
    """
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens_per_sec_per_device = tokens / step_seconds / world_size
    tflops_per_device = flops_per_token * tokens_per_sec_per_device / 1e12
    mfu = None if peak_tflops is None else 100.0 * tflops_per_device / peak_tflops
    return {
        "kind": "train",
        "step": step,
        "samples": samples,
        "tokens": tokens,
        "loss": float(loss),
        "lr": float(lr),
        "step_seconds": step_seconds,
        "samples_per_sec": samples / step_seconds,
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "tflops_per_device": tflops_per_device,
        "mfu": mfu,
        "peak_mem_gib": peak_memory_bytes / GIB,
        "data_wait_pct": 100.0 * data_wait_seconds / step_seconds,
    }


@dataclass
class StepMeter:
    """Times windows of steps between two log lines by the wall clock between two device syncs.

    A GPU runs behind the host: a step's kernels are only paid for when something waits for
    them. Summing per-step host intervals therefore drops whatever the device still owed when an
    interval ended (on an H100 that made ``--logging_freq 5`` report 2.3x the real speed). Here a
    window's time is, by construction, ``clock()`` after a ``sync()`` at :meth:`report` minus
    ``clock()`` after the ``sync()`` that ended the previous window (or :meth:`start`): all device
    work queued in between is inside it, whenever it ran. Work that is not training (validation,
    checkpoint saves) runs inside :meth:`paused`, which syncs at both ends and subtracts its time.

    ``add_step`` only counts (no clock, no sync), so steps between log lines never wait for the
    device. ``sync`` and ``clock`` are injectable so tests can simulate an asynchronous device.

    Each report also carries the time since :meth:`start` and, given ``max_steps``, an estimate
    of the time left (:func:`remaining_seconds`): the median time per step of the windows that
    end after this process's first ``warmup_steps`` steps (a resumed run warms up again).
    """

    flops_per_token: float
    world_size: int
    peak_tflops: float | None
    peak_label: str = ""
    memory_label: str = ""
    sync: Callable[[], None] = field(default=lambda: None, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    max_steps: int | None = None
    warmup_steps: int = 0
    _started: float | None = field(default=None, init=False)
    _counted: int = field(default=0, init=False)
    _step_times: list[float] = field(default_factory=list, init=False, repr=False)
    _window_start: float | None = field(default=None, init=False)
    _paused: float = field(default=0.0, init=False)
    _data_wait: float = field(default=0.0, init=False)
    _samples: int = field(default=0, init=False)
    _tokens: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)

    def start(self) -> None:
        """Open the first window (call once, right before the first step)."""
        self.sync()
        self._window_start = self._started = self.clock()

    def add_step(self, *, data_wait_seconds: float, samples: int, tokens: int) -> None:
        if self._window_start is None:
            raise RuntimeError("StepMeter.start() must be called before the first step")
        self._data_wait += data_wait_seconds
        self._samples += samples
        self._tokens += tokens
        self._steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the enclosed work (validation, a checkpoint save) out of the window's time."""
        self.sync()
        begin = self.clock()
        try:
            yield
        finally:
            self.sync()
            self._paused += self.clock() - begin

    def report(
        self, *, step: int, loss: float, lr: float, peak_memory_bytes: int
    ) -> dict[str, Any]:
        """Metrics of the steps added since the last report; closes the window, opens the next."""
        if self._steps == 0 or self._window_start is None:
            raise RuntimeError("StepMeter.report() called before any add_step()")
        self.sync()
        now = self.clock()
        seconds = now - self._window_start - self._paused
        metrics = step_metrics(
            step=step,
            loss=loss,
            lr=lr,
            step_seconds=seconds,
            data_wait_seconds=self._data_wait,
            samples=self._samples,
            tokens=self._tokens,
            world_size=self.world_size,
            peak_memory_bytes=peak_memory_bytes,
            flops_per_token=self.flops_per_token,
            peak_tflops=self.peak_tflops,
        )
        metrics["window_steps"] = self._steps
        # Wall-clock time of the report: consecutive records give the real elapsed time,
        # including what the window leaves out (validation, checkpoint saves).
        metrics["time"] = time.time()
        metrics["mfu_basis"] = self.peak_label
        metrics["memory_kind"] = self.memory_label
        self._counted += self._steps
        if self._counted > self.warmup_steps:
            self._step_times.append(seconds / self._steps)
        metrics["elapsed_seconds"] = now - self._started  # validation and saves included
        metrics["remaining_seconds"] = (
            None
            if self.max_steps is None
            else remaining_seconds(self._step_times, self.max_steps - step)
        )
        self._window_start, self._paused, self._data_wait = now, 0.0, 0.0
        self._samples = self._tokens = self._steps = 0
        return metrics


def remaining_seconds(step_times: Sequence[float], steps_left: int) -> float | None:
    """Median seconds per step x steps left; None while no window after warm-up exists.

    The median, not the mean, so one slow window (a checkpoint flush, a straggler) does not swing
    the estimate of a multi-day job. Validation and checkpoint time are not in ``step_times``
    (the meter pauses for them), so the estimate is of training time alone.
    """
    if not step_times:
        return None
    return statistics.median(step_times) * max(steps_left, 0)


def format_duration(seconds: float) -> str:
    """Two units, largest first (``2d03h``, ``1h02m``, ``4m05s``, ``12s``): what a person
    tailing a log wants, not a timestamp to decode."""
    whole = max(int(round(seconds)), 0)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def run_record(
    flags: Mapping[str, Any], *, world_size: int, samples_per_step: int
) -> dict[str, Any]:
    """The first JSONL record of a run (and its ``run: {...}`` log line): the resolved flags
    and the global batch, so a comparison can label runs and refuse unlike shapes or batches
    from either the run directory or the Slurm log alone."""
    plain = (str, int, float, bool, type(None), list, tuple, dict)
    return {
        "kind": "run",
        "time": time.time(),
        "world_size": world_size,
        "samples_per_step": samples_per_step,
        "flags": {k: v if isinstance(v, plain) else str(v) for k, v in sorted(flags.items())},
    }


def validation_record(
    *, step: int, val_loss: float, batches: int, seconds: float
) -> dict[str, Any]:
    """The JSONL record of one validation pass (after optimizer step ``step``)."""
    return {
        "kind": "val",
        "step": step,
        "val_loss": float(val_loss),
        "val_batches": batches,
        "val_seconds": seconds,
    }


# ---------------------------------------------------------------------------------------------
# Log lines


def seed_line(step: int, loss: float, samples_per_sec: float, lr: float) -> str:
    """The upstream recipe's line, byte for byte, so existing log parsers keep working."""
    return f"Batch {step} Loss: {loss:.5f}, Speed: {samples_per_sec:.2f} samples/sec, lr: {lr:.6f}"


def run_line(run: Mapping[str, Any]) -> str:
    """``run: {json}``: the run record on one log line, so a Slurm log alone tells a comparison
    the run's flags and global batch (scripts/compare_runs.py reads it back)."""
    return "run: " + json.dumps(_json_safe(run), allow_nan=False)


def _mfu_text(metrics: Mapping[str, Any]) -> str:
    mfu = metrics.get("mfu")
    basis = metrics.get("mfu_basis") or "vs bf16 peak"
    if mfu is None:
        return f"MFU: {basis}" if basis.startswith("n/a") else "MFU: n/a"
    return f"MFU: {mfu:.1f}% ({basis})"


def detail_line(metrics: Mapping[str, Any]) -> str:
    """Second log line: per-device throughput, model TFLOP/s, MFU, memory, data wait."""
    memory_kind = metrics.get("memory_kind") or "peak memory"
    return (
        f"  tokens/s/device: {metrics['tokens_per_sec_per_device']:,.0f}, "
        f"TFLOP/s/device: {metrics['tflops_per_device']:.3f}, "
        f"{_mfu_text(metrics)}, "
        f"peak mem: {metrics['peak_mem_gib']:.2f} GiB ({memory_kind}), "
        f"data wait: {metrics['data_wait_pct']:.1f}%"
        f"{_eta_text(metrics)}"
    )


def _eta_text(metrics: Mapping[str, Any]) -> str:
    """``, elapsed: 1h02m, remaining: ~2d03h`` (appended last, so parsers of the fields before
    it keep working); nothing for records without timing (e.g. from older runs)."""
    if metrics.get("elapsed_seconds") is None:
        return ""
    text = f", elapsed: {format_duration(metrics['elapsed_seconds'])}"
    if "remaining_seconds" not in metrics:
        return text
    remaining = metrics["remaining_seconds"]
    left = "n/a (warm-up)" if remaining is None else f"~{format_duration(remaining)}"
    return f"{text}, remaining: {left}"


# ---------------------------------------------------------------------------------------------
# JSONL


def _json_safe(value: Any) -> Any:
    """Non-finite floats become null: strict JSON has no NaN/Infinity (jq, JS would reject it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class JsonlWriter:
    """Appends one JSON object per line; only the rank that is ``enabled`` touches the file.

    Each record is serialised completely first and then written with a single ``os.write`` on an
    ``O_APPEND`` descriptor, so a serialisation error never leaves half a line and a crash
    between records leaves only whole lines. Appending lets a resumed run continue its file.
    """

    def __init__(self, path: str | os.PathLike[str], *, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._fd: int | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._fd is None:
            return
        data = (json.dumps(_json_safe(record), allow_nan=False) + "\n").encode()
        written = os.write(self._fd, data)
        if written != len(data):  # regular files do not short-write short of a full disk
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# Summary and comparison

# (key in summary, label, format) in display order.
_SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("samples_per_sec", "samples/s (median)", "{:.2f}"),
    ("tokens_per_sec_per_device", "tokens/s/device (median)", "{:,.0f}"),
    ("tflops_per_device", "TFLOP/s/device (median)", "{:.3f}"),
    ("mfu", "MFU % vs bf16 peak (median)", "{:.1f}"),
    ("data_wait_pct", "data wait % (median)", "{:.1f}"),
    ("peak_mem_gib", "peak memory GiB (max)", "{:.2f}"),
    ("final_train_loss", "final train loss", "{:.5f}"),
    ("final_val_loss", "final validation loss", "{:.5f}"),
)
_MEDIAN_KEYS = (
    "samples_per_sec",
    "tokens_per_sec_per_device",
    "tflops_per_device",
    "mfu",
    "data_wait_pct",
)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(records: Iterable[Mapping[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """End-of-run numbers: medians over logged train records with ``step > warmup_steps``.

    Warm-up steps (allocator growth, lazy init, compilation) are excluded from throughput but
    not from the losses: ``final_train_loss`` is the last logged train loss and
    ``final_val_loss`` the last validation record's ``val_loss``. Peak memory is the maximum over
    all records (it is a peak). A metric with no record after warm-up is None.
    """
    records = list(records)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    measured = [r for r in train if r["step"] > warmup_steps]
    summary: dict[str, Any] = {key: _median(r.get(key) for r in measured) for key in _MEDIAN_KEYS}
    memory = [r["peak_mem_gib"] for r in train if r.get("peak_mem_gib") is not None]
    summary["peak_mem_gib"] = max(memory) if memory else None
    summary["final_train_loss"] = train[-1]["loss"] if train else None
    summary["final_val_loss"] = val[-1]["val_loss"] if val else None
    summary["measured_records"] = len(measured)
    summary["warmup_steps"] = warmup_steps
    summary["last_step"] = train[-1]["step"] if train else None
    return summary


def _fmt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_summary(summary: Mapping[str, Any], title: str = "Summary") -> str:
    """Multi-line human summary of :func:`summarize`'s result."""
    head = (
        f"{title} (medians over {summary['measured_records']} logged steps after "
        f"step {summary['warmup_steps']}, last step {summary['last_step']})"
    )
    width = max(len(label) for _, label, _ in _SUMMARY_ROWS)
    lines = [head]
    for key, label, fmt in _SUMMARY_ROWS:
        lines.append(f"  {label:<{width}}  {_fmt(summary.get(key), fmt)}")
    return "\n".join(lines)


def format_comparison(
    baseline: Mapping[str, Any],
    candidate: Mapping[str, Any],
    names: tuple[str, str] = ("bf16", "fp8"),
) -> str:
    """Side-by-side table of two summaries with the candidate/baseline ratio of each metric."""
    return format_table([baseline, candidate], names)


def format_table(summaries: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """Summaries side by side, each after the first followed by its ratio to the first
    (``name/first``): the question is always "what did this change buy over the baseline"."""
    if len(summaries) != len(names) or not summaries:
        raise ValueError(f"{len(summaries)} summaries for {len(names)} names")
    width = max(len(label) for _, label, _ in _SUMMARY_ROWS)
    base, first = summaries[0], names[0]
    cols: list[tuple[str, int]] = []  # (header, width)
    for i, name in enumerate(names):
        cols.append((name, max(12, len(name))))
        if i:
            ratio = f"{name}/{first}"
            cols.append((ratio, max(10, len(ratio))))
    lines = ["  " + f"{'':<{width}}" + "".join(f"  {h:>{w}}" for h, w in cols)]
    for key, label, fmt in _SUMMARY_ROWS:
        cells = []
        for i, summary in enumerate(summaries):
            cells.append(_fmt(summary.get(key), fmt))
            if i:
                a, b = base.get(key), summary.get(key)
                cells.append("n/a" if a is None or b is None or a == 0 else f"{b / a:.3f}")
        row = "".join(f"  {c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True))
        lines.append(f"  {label:<{width}}{row}")
    return "\n".join(lines)
