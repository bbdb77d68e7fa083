"""What a run writes about itself: the JSONL records (run, train, val) and the log lines that
carry the same numbers, so the run directory and the Slurm log each tell the whole story."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model_utils.checkpoint.resume import config_changes


def run_record(
    flags: Mapping[str, Any],
    *,
    world_size: int,
    samples_per_step: int,
    start_step: int | None = None,
) -> dict[str, Any]:
    """The first JSONL record of a launch (and its ``run: {...}`` log line): the resolved flags
    and the global batch, so a comparison can label runs and refuse unlike shapes or batches
    from either the run directory or the Slurm log alone; and the step it starts after (a
    resume's), so what an earlier launch logged past it is known to be undone."""
    plain = (str, int, float, bool, type(None), list, tuple, dict)
    return {
        "kind": "run",
        "time": time.time(),
        "world_size": world_size,
        "samples_per_step": samples_per_step,
        "start_step": start_step,
        "flags": {k: v if isinstance(v, plain) else str(v) for k, v in sorted(flags.items())},
    }


def identity_change(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> str | None:
    """How run record `now` is another run than `before` (``fp8 True, now False``), or None:
    a change a resume of the same run is refused (checkpoint/resume.py's rule, read off each
    flag's resume class: the shape, the data stream, the optimizer's format, the precision and
    its FP8 knobs), or checkpoints that go elsewhere (folders compared by where they lead)."""
    if not before or "flags" not in before or "flags" not in now:
        return None
    refused, _ = config_changes(before["flags"], now["flags"])
    if refused:
        name, old, new = refused[0]
        return f"{name.removeprefix('--')} {old}, now {new}"
    old, new = before["flags"].get("checkpoint_dir"), now["flags"].get("checkpoint_dir")
    if None not in (old, new) and _checkpoint_place(before["flags"]) != _checkpoint_place(
        now["flags"]
    ):
        return f"checkpoint_dir {old}, now {new}"
    return None


def _checkpoint_place(flags: Mapping[str, Any]) -> tuple[str, Path]:
    """Where a run's checkpoints go, as its identity: inside its run folder by the path from
    there (a run folder moved or renamed, then resumed, is the same run), else by where it leads."""
    checkpoints = Path(str(flags["checkpoint_dir"])).resolve()
    if flags.get("output_dir") is not None:
        with contextlib.suppress(ValueError):
            inside = checkpoints.relative_to(Path(str(flags["output_dir"])).resolve())
            return ("in the run folder", inside)
    return ("at", checkpoints)


def first_run_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The first ``run`` record of a metrics file (what its run trained with), None if it has
    none or cannot be read as JSON lines."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("kind") == "run":
                    return record
    return None


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
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._drop_unfinished_line()

    def _drop_unfinished_line(self) -> None:
        """A record cut short (the machine died mid-write) would swallow the next one appended
        after it: cut the file back to its last whole line."""
        size = os.fstat(self._fd).st_size
        tail = os.pread(self._fd, min(size, 1 << 16), max(0, size - (1 << 16)))
        if tail and not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1  # 0 if no newline in the tail
            os.ftruncate(self._fd, size - len(tail) + cut)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one line. OSError if the file system refuses it (full, quota, I/O error),
        with the file cut back to the whole lines it held before."""
        if self._fd is None:
            return
        # a null grad norm is also a run without --grad_clip: the record names what was NaN/inf
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {**record, "not_finite": bad} if bad else record
        data = (json.dumps(_json_safe(record), allow_nan=False) + "\n").encode()
        whole = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # regular files do not short-write short of a full disk
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} bytes")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, whole)  # no half line for a reader to trip on
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Move an earlier run's non-empty metrics file (or TensorBoard folder) out of a fresh
    run's way, to the first free ``metrics.N.jsonl`` (``tensorboard.N``) beside it, and return
    where; None if there was nothing to move. A fresh run appending to it would mix two runs in
    one summary, comparison or chart; deleting it would lose what the user saved."""
    path = Path(path)
    if not path.exists():
        return None
    if path.stat().st_size == 0 if path.is_file() else not any(path.iterdir()):
        return None
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.rename(path, aside)
    return aside


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in order; ValueError naming the line of one the summary
    could not use (a file edited by hand: a string step was a TypeError in the end summary's
    sort, after the run's last checkpoint)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                record = json.loads(line)
                problem = record_problem(record)
                if problem:
                    raise ValueError(f"line {number} {problem}")
                records.append(record)
    return records


# ---- Log lines


def seed_line(step: int, loss: float, samples_per_sec: float, lr: float) -> str:
    """The upstream recipe's line, byte for byte, so existing log parsers keep working."""
    return f"Batch {step} Loss: {loss:.5f}, Speed: {samples_per_sec:.2f} samples/sec, lr: {lr:.6f}"


def upstream_validation_line(step: int, val_loss: float) -> str:
    """The upstream recipe's validation line, so a parser of its logs finds validation too
    (written beside this recipe's own, which says over how many batches)."""
    return f"Batch {step} Validation loss: {val_loss:.5f}"


def run_line(jsonl_path: str | os.PathLike[str], args_path: str | os.PathLike[str]) -> str:
    """``run: record in DIR/metrics.jsonl, flags in DIR/run.args``: where the run's whole record
    (flags, world, global batch) is kept, which analysis/compare_runs.py reads for a Slurm
    log; the log itself shows a person the model, precision and world lines."""
    return f"run: record in {Path(jsonl_path).absolute()}, flags in {Path(args_path).absolute()}"


def _mfu_text(metrics: Mapping[str, Any]) -> str:
    mfu = metrics.get("mfu")
    basis = metrics.get("mfu_basis") or "vs bf16 peak"
    if mfu is None:
        return f"MFU: {basis}" if basis.startswith("n/a") else "MFU: n/a"
    return f"MFU: {mfu:.1f}% ({basis})"


def tflops_text(tflops: float) -> str:
    """Three decimals on a GPU (711.234); four significant digits below 1 TFLOP/s (a CPU's
    0.0001234), where three decimals printed 0.000 for both runs and the ratio of the rounded
    values read back from a log was 0/0 or off by a third."""
    return f"{tflops:.3f}" if abs(tflops) >= 1 else f"{tflops:.4g}"


def detail_line(metrics: Mapping[str, Any]) -> str:
    """Second log line: per-device throughput, model TFLOP/s, MFU, memory, data wait, the
    gradient norm, then the tokens seen and the time."""
    memory_kind = metrics.get("memory_kind") or "peak memory"
    return (
        f"  tokens/s/device: {metrics['tokens_per_sec_per_device']:,.0f}, "
        f"TFLOP/s/device: {tflops_text(metrics['tflops_per_device'])}, "
        f"{_mfu_text(metrics)}, "
        f"peak mem: {metrics['peak_mem_gib']:.2f} GiB ({memory_kind}), "
        f"data wait: {metrics['data_wait_pct']:.1f}%"
        f"{_grad_norm_text(metrics)}{_seen_text(metrics)}{_eta_text(metrics)}"
    )


def _grad_norm_text(metrics: Mapping[str, Any]) -> str:
    """``, grad norm: 0.873``: the report step's global norm before clipping, the first sign
    of a loss spike to come (none with --grad_clip 0, which computes no norm)."""
    norm = metrics.get("grad_norm")
    return "" if norm is None else f", grad norm: {norm:.4g}"


def _seen_text(metrics: Mapping[str, Any]) -> str:
    """``, seen: 1.23M tokens``: the run's tokens over all its launches (none in older records)."""
    tokens = metrics.get("tokens_seen")
    if tokens is None:
        return ""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= size:
            return f", seen: {tokens / size:.2f}{unit} tokens"
    return f", seen: {tokens} tokens"


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


def format_duration(seconds: float) -> str:
    """Two units, largest first (``2d03h``, ``1h02m``, ``4m05s``, ``12s``): what a person
    tailing a log wants, not a timestamp to decode."""
    whole = max(int(round(seconds)), 0)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    pairs = ((days, "d", hours, "h"), (hours, "h", minutes, "m"), (minutes, "m", secs, "s"))
    for big, big_unit, small, small_unit in pairs:
        if big:
            return f"{big}{big_unit}{small:02d}{small_unit}"
    return f"{secs}s"


# ---- Reading records back (analysis/compare_runs.py): what a reader may rely on

#: The field each record kind a reader compares must hold.
REQUIRED_FIELD = {"train": "loss", "val": "val_loss"}
#: The numbers (or null) of train and val records (metrics.meter.step_metrics, validation_record)
#: that the end summary, and compare_runs' table and picture, read.
RECORD_NUMBERS = (
    "loss",
    "val_loss",
    "lr",
    "samples_per_sec",
    "tokens_per_sec_per_device",
    "tflops_per_device",
    "mfu",
    "data_wait_pct",
    "peak_mem_gib",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float, not a bool (an int to Python, but no figure: JSON true)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_problem(info: Mapping[str, Any]) -> str | None:
    """Why a run record's flags cannot be read (labels, the like-for-like check and the warm-up
    rule read them), or None."""
    flags = info.get("flags", {})
    if not isinstance(flags, dict):
        return f"has flags {flags!r}, not an object"
    if flags.get("max_steps") is not None and not _is_int(flags["max_steps"]):
        return f"has the flag max_steps {flags['max_steps']!r}, not a whole number"
    return None


def record_problem(record: Any) -> str | None:
    """Why a metrics.jsonl record cannot be compared, or None: the kinds a comparison reads hold
    a whole-number step, their loss, and numbers (or null) in RECORD_NUMBERS. A string
    step failed as a TypeError in the sort, flags that are no object as an AttributeError."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    kind = record.get("kind")
    if kind == "run":
        return run_problem(record)
    if kind not in REQUIRED_FIELD:
        return None  # a kind no comparison reads
    if not _is_int(record.get("step")) or record["step"] < 0:
        return f"has step {record.get('step')!r}, not a whole number >= 0"
    if REQUIRED_FIELD[kind] not in record:
        return f"has no {REQUIRED_FIELD[kind]!r}"
    for key in RECORD_NUMBERS:
        if record.get(key) is not None and not is_number(record[key]):
            return f"has {key} {record[key]!r}, not a number"
    loss = record[REQUIRED_FIELD[kind]]
    if is_number(loss) and loss <= 0:  # NaN and inf pass: a diverged run's verdict says so
        return f"has {REQUIRED_FIELD[kind]} {loss}: a cross-entropy loss is above 0"
    return None
