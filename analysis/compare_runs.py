"""Compare training runs: a table of medians with each run's ratio to the first, and one PNG.

    python -m analysis.compare_runs slurm-101.out slurm-102.out                # two Slurm logs
    python -m analysis.compare_runs runs/tiny-bf16 runs/tiny-fp8 --output fp8.png
    python -m analysis.compare_runs a.out b.out c.out --labels bf16,fp8-te,fp8-ao --log_steps
    python -m analysis.compare_runs runs/a-bf16 runs/a-fp8 --breakdown          # profiled runs
    python -m analysis.compare_runs runs/bf16 runs/bf16-seed43 runs/fp8 --replicas 2  # seed noise
    python -m analysis.compare_runs runs/tiny-bf16 runs/tiny-fp8 --tracker wandb,mlflow

A run is a run directory (its metrics.jsonl), a metrics.jsonl file, or any log with the seed line
``Batch N Loss: L, Speed: S samples/sec, lr: R`` (this recipe's slurm-<job>.out, the upstream
recipe's, a job still running); its flags, where it has them, label it and let the tool refuse
unlike runs. After the table each run after the reference gets a parity verdict against it
(analysis/parity.py), the picture is analysis/compare_plot.py's, ``--tracker`` sends both to
W&B, MLflow or TensorBoard (analysis/compare_trackers.py). Bad input is one line on stderr
naming the file (and line), exit 2, before anything is written. What each figure means and the
rules behind it: docs/metrics.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import runpy
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "environment_check.py"))
from analysis import compare_trackers, parity
from analysis.compare_plot import DPI, X_AXES, Breakdown, make_figure, missing_x
from model_utils.config.sections import ModelShape, flag_fields, precision_name
from model_utils.errors import OneLineParser, Refusal, UsageError, os_error_words, said, write_whole
from model_utils.precision import numerics
from model_utils.report import metrics
from model_utils.report.metrics.records import (
    first_run_record,
    is_number,
    record_problem,
    run_problem,
)
from model_utils.report.metrics.summary import SPEED_WARMUP_STEPS, one_per_step

_NUM = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))"
_GROUPED = r"(\d{1,3}(?:,\d{3})*(?:\.\d+)?)"  # 1,234,567 (the detail line's tokens/s)
SEED = re.compile(rf"Batch (\d+) Loss: {_NUM}, Speed: {_NUM} samples/sec, lr: {_NUM}")
VALIDATION = re.compile(rf"Validation at step (\d+): loss {_NUM}")
# The upstream recipe's validation line (this recipe prints it too, after its own).
UPSTREAM_VALIDATION = re.compile(rf"Batch (\d+) Validation loss: {_NUM}")
#: train.py's run line names the run's metrics.jsonl, whose first record is the run's; an older
#: log's run line holds the record itself.
RECORD = re.compile(r"\brun: record in (.+?metrics\.jsonl), flags in ")
RUN = re.compile(r"\brun: (\{.*\})\s*$")
#: resume.py's line: what earlier launches logged past its step was abandoned (an older checkpoint)
RESUMED = re.compile(r"\bResumed from .+ at step (\d+) \(data checked: ")
# The second line of this recipe (metrics.detail_line): JSONL key -> its field.
DETAIL = {
    "tokens_per_sec_per_device": re.compile(rf"tokens/s/device: {_GROUPED}"),
    "tflops_per_device": re.compile(rf"TFLOP/s/device: {_NUM}"),
    "mfu": re.compile(rf"MFU: {_NUM}%"),
    "peak_mem_gib": re.compile(rf"peak mem: {_NUM} GiB"),
    "data_wait_pct": re.compile(rf"data wait: {_NUM}%"),
}
# What must match for two runs to be compared like for like (flags of the run record): the
# model section's flags (shape, context, RoPE base) and the micro-batch.
SHAPE_FLAGS = flag_fields(ModelShape)
#: What each step trains on, and what the validation loss is a mean over.
BATCH_FLAGS = ("train_batch_size", "val_batch_size", "validation_batches")


class CompareError(UsageError):
    """Input the tool refuses: printed as one line, exit code 2."""


@dataclass
class Options:
    """What to compare and how: the command line's flags, or a caller's (make demo's pair)."""

    runs: Sequence[str | os.PathLike[str]]
    output: Path
    labels: str | None = None  # comma-separated, one per run
    log_steps: bool = False
    x: str = "step"
    warmup_steps: int | None = None
    allow_mismatch: bool = False
    title: str | None = None
    breakdown: bool = False
    replicas: int = 1  # the first N runs: the reference and its seed replicas
    tracker: str = ""  # comma-separated tracker names, or "runs": those the runs used


@dataclass
class Run:
    source: Path
    records: list[dict[str, Any]]  # train and val records, metrics.jsonl schema, one per step
    info: dict[str, Any] | None  # the run record (flags, world_size, samples_per_step), if any
    numerics: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # --fp8_numerics
    resumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # later run records

    @property
    def fallback_label(self) -> str:
        """Directory name for run directories and their metrics.jsonl, file stem for logs."""
        if self.source.is_dir():
            return self.source.resolve().name
        if self.source.suffix == ".jsonl":
            return self.source.resolve().parent.name
        return self.source.stem

    @property
    def last_step(self) -> int:
        return max(r["step"] for r in self.records if r["kind"] == "train")


# ------------------------------------------------------------------------------------ parsing


def complete_lines(text: str) -> list[str]:
    """The lines of ``text`` that are finished: a file still being written (a running job's log)
    may end in half a line, e.g. ``lr: 0.0001`` of ``lr: 0.000100``, which would parse wrongly."""
    return text.split("\n")[:-1]  # after the last "\n": "" if finished, else the partial line


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_log(text: str, name: str = "log") -> tuple[list[dict], list[dict]]:
    """Records from a training log: seed lines (+ this recipe's detail line), validation lines
    (this recipe's or upstream's ``Batch N Validation loss: X``), and the ``run: {...}`` lines
    (one a start). Anything else (timestamps, srun's ``0:`` prefix, other
    ranks' warnings) is ignored."""
    records: list[dict[str, Any]] = []
    infos, last_train, val_steps, kept = [], None, set(), []
    for number, line in enumerate(complete_lines(text), start=1):
        if m := RECORD.search(line):  # read once the log's next step is known (below)
            kept.append((number, m.group(1), len(records)))
        elif m := SEED.search(line):
            last_train = {
                "kind": "train",
                "step": int(m.group(1)),
                "loss": _number(m.group(2)),
                "samples_per_sec": _number(m.group(3)),
                "lr": _number(m.group(4)),
            }
            records.append(last_train)
        elif "tokens/s/device:" in line and last_train is not None:
            for key, pattern in DETAIL.items():
                if (m := pattern.search(line)) and key not in last_train:
                    last_train[key] = _number(m.group(1))
            last_train = None  # one detail line per seed line
        elif (m := VALIDATION.search(line) or UPSTREAM_VALIDATION.search(line)) and int(
            m.group(1)
        ) not in val_steps:  # one record per validation, from whichever line came first
            val_steps.add(int(m.group(1)))
            records.append(
                {"kind": "val", "step": int(m.group(1)), "val_loss": _number(m.group(2))}
            )
        elif m := RESUMED.search(line):  # as a launch's run record's start_step: one_per_step
            records.append({"kind": "run", "start_step": int(m.group(1))})
        elif (found := logged_run(line)) is not None and run_problem(found) is None:
            infos.append(one_run(infos, found, name, number, "log"))  # else not ours: any text
        if records and (problem := record_problem(records[-1])):  # the rules of a metrics.jsonl
            raise CompareError(f"{name}: line {number} {problem}: fix or delete that line")
    read: dict[Path, list[dict]] = {}  # each metrics file once, however many relaunches name it
    for number, path, at in kept:
        step = next((r for r in records[at:] if r["kind"] == "train"), None)
        for record in records[at:] if step and number != kept[0][0] else ():  # a relaunch's
            if record["kind"] == "train" and record["step"] < step["step"] + SPEED_WARMUP_STEPS:
                record["speed_warmup"] = True  # first steps warm up again, as its records say
        if (found := kept_record(path, step, read)) is not None and run_problem(found) is None:
            infos.append(one_run(infos, found, name, number, "log"))
    return records, infos


def kept_record(path: str, step: Mapping[str, Any] | None, read: dict) -> dict | None:
    """The run record a log's run line names, from the file that logged the log's next ``step``
    with its loss: a later fresh run in that folder set this run's file aside
    (``metrics.N.jsonl``), and its own would re-label the log (None: no file holds it)."""
    if step is None:
        return first_run_record(path)
    for file in [Path(path), *sorted(Path(path).parent.glob("metrics.*.jsonl"))]:
        with contextlib.suppress(OSError, ValueError):
            if file not in read:
                read[file] = metrics.read_jsonl(file)
            same = (
                r["loss"]
                for r in read[file]
                if r.get("kind") == "train" and r.get("step") == step["step"]
            )
            if any(is_number(loss) and abs(loss - step["loss"]) <= 6e-6 for loss in same):
                return first_run_record(file)
    return None


def logged_run(line: str) -> Any:
    """The record an older log's run line holds (None: not such a line, or not JSON)."""
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(m.group(1)) if (m := RUN.search(line)) else None
    return None


def one_run(infos: Sequence[dict], found: dict, name: str, number: int, what: str) -> dict:
    """``found``, a run record after ``infos``: the first says what the run trained (a resume
    writes another, and one that changed what it compares would re-label an FP8 run as bf16);
    one that changed what the run is (a file or log from before train.py kept one run per
    file) is refused."""
    change = metrics.identity_change(infos[0] if infos else None, found)
    if change:
        raise CompareError(
            f"{name}: line {number} starts another run ({change}): the {what} holds two runs; "
            f"split it at line {number} and compare the parts"
        )
    return found


def parse_jsonl(text: str, name: str) -> tuple[list[dict], list[dict]]:
    """Records of a metrics.jsonl; a bad line is refused unless it is the unfinished last one:
    one that is not JSON, or a record of a kind this tool reads whose fields it cannot use.
    The train, val and numerics (--fp8_numerics) records."""
    records, infos = [], []
    for number, line in enumerate(complete_lines(text), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = record_problem(record)
        except json.JSONDecodeError as exc:
            problem = f"is not JSON ({exc.msg})"
        if problem:
            raise CompareError(f"{name}: line {number} {problem}: fix or delete that line")
        kind = record.get("kind")
        if kind == "run":
            infos.append(one_run(infos, record, name, number, "file"))
            records.append(record)  # its start_step undoes what earlier launches logged past it
        elif kind in ("train", "val") or (
            kind == "numerics" and isinstance(record.get("layers"), dict)
        ):
            records.append(record)
    return records, infos


def load_run(path: str | os.PathLike[str]) -> Run:
    """A run from a run directory, a .jsonl file or a log; refuses one with no train record."""
    source = Path(path)
    try:
        file = source / "metrics.jsonl" if source.is_dir() else source
        if not file.is_file():
            what = "a directory without metrics.jsonl" if source.is_dir() else "no such file"
            raise CompareError(f"{source}: {what}")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:  # a name over 255 bytes, no permission
        raise CompareError(f"{source}: cannot be read ({os_error_words(exc)})") from exc
    records, infos = (parse_jsonl if file.suffix == ".jsonl" else parse_log)(text, str(file))
    figures = [r for r in records if r["kind"] == "numerics"]
    records = one_per_step([r for r in records if r["kind"] != "numerics"])
    if not any(r["kind"] == "train" for r in records):
        if infos:  # a run record alone: the run started and logged no step (yet)
            raise CompareError(f"{file}: no train record yet (the run logged no step)")
        raise CompareError(
            f"{file}: no parsable line (expected metrics.jsonl records or "
            "'Batch N Loss: L, Speed: S samples/sec, lr: R' lines)"
        )
    return Run(source, records, infos[0] if infos else None, figures, infos[1:])


# ------------------------------------------------------------------------- labels and checks


def label_from_flags(info: Mapping[str, Any] | None) -> str | None:
    """``fp8 tensorwise hf``, ``bf16 te adamw8bit``, ``fp8 delayed te fp8-attention``:
    precision, FP8 recipe (FP8 runs), implementation, FP8 attention and --bf16_layers when on,
    the optimizer where it is not the default adamw, and ``bf16-params`` with --master_weights
    optimizer."""
    if not info or "flags" not in info:
        return None
    flags = info["flags"]
    fp8 = flags.get("fp8")
    optional = [  # (shown, its word)
        (fp8 and flags.get("fp8_recipe"), str(flags.get("fp8_recipe"))),
        (flags.get("model_impl"), str(flags.get("model_impl"))),
        (fp8 and flags.get("fp8_attention"), "fp8-attention"),
        (fp8 and flags.get("fp8_lm_head"), "fp8-lm_head"),
        (fp8 and flags.get("bf16_layers"), f"bf16-layers {flags.get('bf16_layers')}"),
        (flags.get("optimizer", "adamw") != "adamw", str(flags.get("optimizer"))),
        (flags.get("master_weights", "params") != "params", "bf16-params"),  # fp32 masters
    ]
    precision = precision_name(fp8, flags.get("bf16", True))
    return " ".join([precision, *(word for shown, word in optional if shown)])


def default_labels(runs: Sequence[Run]) -> list[str]:
    """Labels from flags (file names where there are none), made unique by the file name."""
    first = [label_from_flags(r.info) or r.fallback_label for r in runs]
    labels = [
        f"{label} ({run.fallback_label})"
        if first.count(label) > 1 and label != run.fallback_label
        else label
        for label, run in zip(first, runs, strict=True)
    ]
    for i in range(len(labels)):
        if labels[:i].count(labels[i]):
            labels[i] = f"{labels[i]} #{i + 1}"
    return labels


def _like_for_like(info: Mapping[str, Any]) -> dict[str, Any]:
    flags = info.get("flags", {})
    keys = {k: flags.get(k) for k in (*SHAPE_FLAGS, *BATCH_FLAGS)}
    return {**keys, "global batch": info.get("samples_per_step")}


def mismatches(runs: Sequence[Run], labels: Sequence[str]) -> list[str]:
    """What differs from the first run with flags, in model shape or batch size: a 2x speed-up
    from halving the model or doubling the batch is not FP8's."""
    known = [(r, lab) for r, lab in zip(runs, labels, strict=True) if r.info]
    if not known:
        return []
    reference, first_label = _like_for_like(known[0][0].info), known[0][1]
    resumed = [  # a resume that changed the batch or context mixes two runs' figures
        f"{label}: {key} {value} after a resume ({_like_for_like(run.info)[key]} before)"
        for run, label in known
        for later in run.resumes
        for key, value in _like_for_like(later).items()
        if value != _like_for_like(run.info)[key]
    ]
    return resumed + [
        f"{label}: {key} {value} vs {reference[key]} ({first_label})"
        for run, label in known[1:]
        for key, value in _like_for_like(run.info).items()
        if value != reference[key]
    ]


def data_order(flags: Mapping[str, Any]) -> Any:
    """The seed that orders a run's data: --data_seed, else --seed."""
    return flags.get("seed") if flags.get("data_seed") is None else flags.get("data_seed")


def train_losses(run: Run) -> dict[int, Any]:
    return {r["step"]: r.get("loss") for r in run.records if r["kind"] == "train"}


def replica_problems(runs: Sequence[Run], labels: Sequence[str]) -> list[str]:
    """What keeps runs[1:] from being seed replicas of runs[0]: another precision or recipe
    (their label), another data order, or the same --seed (runs without flags: unchecked)."""
    problems = [
        f"{label}: every loss it logged is {labels[0]}'s, so it measures no seed noise: a "
        "replica starts from other weights (another --seed, not --init_from_hf) (--replicas)"
        for run, label in zip(runs[1:], labels[1:], strict=True)
        if train_losses(run) == train_losses(runs[0])
    ]
    if len(runs) < 2 or not runs[0].info:
        return problems
    reference = runs[0].info.get("flags", {})
    for run, label in zip(runs[1:], labels[1:], strict=True):
        if not run.info:
            continue
        flags = run.info.get("flags", {})
        if label_from_flags(run.info) != label_from_flags(runs[0].info):
            problems.append(f"{label}: a replica must run as {labels[0]} does (--replicas)")
        if data_order(flags) != data_order(reference):
            problems.append(
                f"{label}: a replica must read the reference's data: --data_seed "
                f"{data_order(reference)} (--replicas)"
            )
        if flags.get("seed") == reference.get("seed"):
            problems.append(
                f"{label}: a replica needs another --seed than {labels[0]} (--replicas)"
            )
    return problems


def default_warmup(runs: Sequence[Run]) -> int:
    """train.py's rule, min(SPEED_WARMUP_STEPS, max_steps // 2), over the shortest run, so the table
    shows the medians of each run's own end-of-run summary (its last launch's --max_steps)."""
    flags = [((run.resumes or [run.info])[-1] or {}).get("flags", {}) for run in runs]
    steps = [int(f.get("max_steps") or run.last_step) for f, run in zip(flags, runs, strict=True)]
    return min(SPEED_WARMUP_STEPS, min(steps) // 2)


# ------------------------------------------------------------------------------ the table


def format_report(
    runs: Sequence[Run],
    labels: Sequence[str],
    summaries: Sequence[Mapping[str, Any]],
    warmup: int,
    problems: Sequence[str] = (),
) -> str:
    """Where each column comes from, the metrics.format_table table, and what was not checked.
    Runs that differ (allowed with --allow_mismatch) are starred, with the differences listed
    above the table so nobody reads its ratios without them."""
    lines = [f"Medians after step {warmup}; ratios are to {labels[0]}."]
    for label, run, summary in zip(labels, runs, summaries, strict=True):
        star = " *" if any(p.startswith(f"{label}: ") for p in problems) else ""
        lines.append(
            f"  {label}{star}: {run.source} ({summary['measured_records']} logged steps "
            f"measured, last step {summary['last_step']})"
        )
    if problems:
        lines.append("* NOT LIKE FOR LIKE (--allow_mismatch): " + "; ".join(problems))
    lines.append(metrics.format_table(summaries, labels))
    lines += world_lines(runs, labels)
    unchecked = [label for label, run in zip(labels, runs, strict=True) if not run.info]
    if unchecked:
        lines.append(
            "Model shape and batch not checked for "
            + ", ".join(unchecked)
            + " (no 'run:' line: a log of the upstream recipe or of an older run)"
        )
    return "\n".join(lines)


def world_lines(runs: Sequence[Run], labels: Sequence[str]) -> list[str]:
    """A line where the runs trained on different numbers of devices: the /device rows then
    compare one device's work, not the runs' times."""
    worlds = {
        lab: r.info["world_size"]
        for r, lab in zip(runs, labels, strict=True)
        if (r.info or {}).get("world_size")
    }
    if len(set(worlds.values())) < 2:
        return []
    each = ", ".join(f"{label} {world}" for label, world in worlds.items())
    return [
        f"Devices differ ({each}): the /device rows compare one device's work; samples/s, "
        "matched time and the same-loss speed compare the whole runs"
    ]


# ---------------------------------------------------------------------------------- output


def check_output(path: Path) -> None:
    """Refuse an output the PNG cannot be written to before any work is done."""
    if path.suffix.lower() != ".png":
        raise CompareError(f"--output {path}: must end in .png")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        if path.is_dir():
            raise CompareError(f"--output {path}: is a directory")
        if not parent.is_dir():
            raise CompareError(f"--output {path}: {parent} is not a directory")
        writable = os.access(parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    except OSError as exc:  # a name over 255 bytes
        raise CompareError(f"--output {path}: {os_error_words(exc)}") from exc
    if not writable:
        raise CompareError(f"--output {path}: not writable")


def parse_args(argv: Sequence[str] | None) -> Options:
    p = OneLineParser(description=__doc__.split("\n\n")[0], raises=CompareError)
    p.add_argument("runs", nargs="+", help="run directories, metrics.jsonl files or logs")
    p.add_argument(
        "--output",
        type=Path,
        help="PNG to write (default: compare_runs.png in the last run's folder when it is a run "
        "folder, else in the current directory)",
    )
    p.add_argument("--labels", help="comma-separated, one per run (default: from the flags)")
    p.add_argument("--log_steps", action="store_true", help="log-scaled step axes")
    p.add_argument(
        "--x",
        choices=tuple(X_AXES),
        default="step",
        help="what loss and throughput are drawn against: step, or tokens seen (runs of "
        "another batch size side by side; the loss gap stays step for step)",
    )
    p.add_argument(
        "--warmup_steps",
        type=int,
        help="steps left out of the medians "
        f"(default: train.py's, min({SPEED_WARMUP_STEPS}, max_steps // 2))",
    )
    p.add_argument(
        "--allow_mismatch",
        action="store_true",
        help="compare unlike model shapes or batch sizes (marked)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="the first N runs are the reference and its seed replicas (BF16 runs that differ "
        "in --seed alone, same --data_seed): the runs after them are judged against the noise "
        "band the replicas span (default 1: the first run alone, the fixed ±1%% band)",
    )
    p.add_argument("--title", help="figure title (default: the labels)")
    p.add_argument(
        "--tracker",
        default="",
        metavar="NAME[,NAME]|runs",
        help="also log the comparison (gap and band per step, picture, verdict) as a run of its "
        "own to tensorboard, wandb, mlflow, or the runs' own trackers (runs): docs/trackers.md",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="a fifth panel: each run's profiled step as a stacked bar, with FP8's ceiling for "
        "an fp8/bf16 pair (run folders trained with --profile_steps; the numbers: "
        "python -m analysis.step_breakdown)",
    )
    return checked_options(p.parse_args(argv))


def checked_options(args: argparse.Namespace) -> Options:
    """The command line's values, each refused in one line where it cannot be used."""
    if len(args.runs) < 2:
        raise CompareError("give two or more runs to compare")
    if not 1 <= args.replicas < len(args.runs):
        raise CompareError(
            f"--replicas {args.replicas}: the reference and its replicas are the first N of the "
            f"{len(args.runs)} runs, with at least one run after them to judge"
        )
    places = [re.sub(r"/metrics\.jsonl$", "", os.path.realpath(path)) for path in args.runs]
    twice = [p for p, place in zip(args.runs, places, strict=True) if places.count(place) > 1]
    if twice:
        raise CompareError(f"{twice[0]} is given twice: each run is compared once")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise CompareError(f"--warmup_steps must be >= 0, got {args.warmup_steps}")
    if args.output is None:
        args.output = default_output(args.runs)
    return Options(**vars(args))


def step_breakdowns(paths: Sequence[str | os.PathLike[str]]) -> Breakdown:
    """The runs' profiled steps (analysis/step_breakdown.py reads the traces), for the picture."""
    from analysis import step_breakdown

    try:
        found = [step_breakdown.read_run(Path(path), None) for path in paths]
    except step_breakdown.Refused as exc:
        raise CompareError(f"--breakdown: {exc}") from exc
    pair = step_breakdown.fp8_pair(found)
    found_ceiling = step_breakdown.ceiling(*pair) if pair else None
    ms = [dict(run.slowest.ms) for run in found]
    return Breakdown(ms, found_ceiling.sentence() if found_ceiling else None)


def default_output(runs: Sequence[str | os.PathLike[str]]) -> Path:
    """Where the picture goes unless --output says: beside the last run's records when it is a
    run folder (runs/ is the user's, git-ignored), so a comparison never adds an untracked
    file to the repository it was run from; else compare_runs.png here (git-ignored too)."""
    last = Path(runs[-1])
    return last / "compare_runs.png" if last.is_dir() else Path("compare_runs.png")


def given_labels(given: str | None, runs: Sequence[Run]) -> list[str]:
    """--labels, one distinct non-empty name a run, or the runs' own labels."""
    if given is None:
        return default_labels(runs)
    labels = [s.strip() for s in given.split(",")]
    if len(labels) != len(runs) or not all(labels) or len(set(labels)) != len(labels):
        raise CompareError(f"--labels needs {len(runs)} distinct non-empty names, got {given!r}")
    return labels


def checked(args: Options, runs: Sequence[Run], labels: Sequence[str]) -> list[str]:
    """What makes the runs unlike (refused unless --allow_mismatch) and a run without --x."""
    problems = mismatches(runs, labels) + replica_problems(
        runs[: args.replicas], labels[: args.replicas]
    )
    if problems and not args.allow_mismatch:
        raise CompareError(
            "runs are not like for like: " + "; ".join(problems) + " (--allow_mismatch to go on)"
        )
    lacking = [str(p) for p, run in zip(args.runs, runs, strict=True) if missing_x(run, args.x)]
    if lacking:
        raise CompareError(
            f"--x {args.x}: {', '.join(lacking)} record no {X_AXES[args.x]} (a log, or a run of "
            "an earlier version): compare them by step"
        )
    return problems


def compare(args: Options) -> str:
    """Load, check, tabulate, plot (and send to --tracker); returns the report text. Raises
    CompareError, before anything is written where the input is bad."""
    check_output(args.output)
    runs = [load_run(path) for path in args.runs]
    labels = given_labels(args.labels, runs)
    trackers = compare_trackers.tracker_names(args.tracker, [run.info for run in runs])
    problems = checked(args, runs, labels)
    warmup = default_warmup(runs) if args.warmup_steps is None else args.warmup_steps
    shortest = min(run.last_step for run in runs)
    if args.warmup_steps is not None and warmup >= shortest:  # every median would be n/a
        raise CompareError(f"--warmup_steps {warmup} leaves no step: a run ends at {shortest}")
    summaries = [metrics.summarize(run.records, warmup) for run in runs]
    unsteady = unsteady_lines(runs, labels, warmup)
    judged_from = {i: parity_start([runs[0], run]) for i, run in enumerate(runs)}
    replicas = [run.records for run in runs[1 : args.replicas]]
    verdicts = [
        parity.judge(
            run.records,
            runs[0].records,
            judged_from[i],
            label,
            labels[0],
            None if unsteady else speed_ratio(summaries, i),
            replicas,
        )
        for i, (run, label) in enumerate(zip(runs, labels, strict=True))
        if i >= args.replicas
    ]
    breakdown = step_breakdowns(args.runs) if args.breakdown else None
    figure = make_figure(
        runs,
        labels,
        summaries,
        log_steps=args.log_steps,
        title=args.title,
        breakdown=breakdown,
        x=args.x,
        judged_from=min(judged_from[i] for i in range(args.replicas, len(runs))),
        noise=verdicts[0].noise if verdicts else None,
    )
    try:  # whole or not at all: a full disk leaves the previous picture, not half of one
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI)
        write_whole(Path(args.output), buffer.getvalue())
    except OSError as exc:
        raise CompareError(f"--output {args.output}: {exc.strerror or exc}") from exc
    report = format_report(runs, labels, summaries, warmup, problems)
    numbers = [numerics_lines(run, label) for run, label in zip(runs, labels, strict=True)]
    verdict_lines = [line for v in verdicts for line in v.lines()]
    text = "\n".join([report, *unsteady, *verdict_lines, *sum(numbers, [])])
    sent = compare_trackers.send(trackers, runs, labels, verdicts, args.output, text)
    return "\n".join([text, *sent])


def speed_ratio(summaries: Sequence[Mapping[str, Any]], index: int) -> float | None:
    """Run ``index``'s median samples/s over the first run's: the ratio of their steps per
    second (one global batch), what matched time and the same-loss speed need. It is the
    tokens/s/device ratio where the worlds match, and is in an upstream log (no tokens/s) and
    in runs on different numbers of devices (where the per-device ratio is not the time's)."""
    mine, theirs = (summaries[i].get("samples_per_sec") for i in (index, 0))
    return mine / theirs if mine and theirs else None


#: Samples/s that vary more than this between a run's 10th- and 90th-percentile steps after
#: warm-up were measured under changing load (another job, clocks): no speed is made of them.
SPEED_SPREAD = 1.25


def speed_spread(run: Run, warmup: int) -> float | None:
    """The run's samples/s at its 90th-percentile step over its 10th (None: under 10 steps)."""
    speeds = [
        r["samples_per_sec"]
        for r in run.records
        if r["kind"] == "train" and r["step"] > warmup and r.get("samples_per_sec")
    ]
    if len(speeds) < 10:
        return None
    deciles = statistics.quantiles(speeds, n=10)
    return deciles[-1] / deciles[0] if deciles[0] > 0 else None


def unsteady_lines(runs: Sequence[Run], labels: Sequence[str], warmup: int) -> list[str]:
    """One line per run whose speed moved within itself, so its time-to-loss is left out."""
    spreads = [speed_spread(run, warmup) for run in runs]
    return [
        f"speed: {label}'s samples/s varied {spread:.2f}x within the run (90th over 10th "
        "percentile step; other load on the machine?): no matched-time or same-loss speed is "
        "made of it; measure both runs again on a quiet machine"
        for label, spread in zip(labels, spreads, strict=True)
        if spread is not None and spread > SPEED_SPREAD
    ]


def numerics_lines(run: Run, label: str, count: int = 3) -> list[str]:
    """The layers whose FP8 casts lose the most at the run's last --fp8_numerics step: the
    largest underflow and saturation, layer and tensor named."""
    if not run.numerics:
        return []
    last = max(run.numerics, key=lambda r: r["step"])
    lines = [f"FP8 numerics of {label} at step {last['step']} ({len(last['layers'])} linears):"]
    for key, words in (("underflow_pct", "underflow"), ("saturation_pct", "saturation")):
        top = [t for t in numerics.worst(last["layers"], key, count) if t[2] > 0]
        cells = ", ".join(f"{layer} {role} {value:.3f}%" for layer, role, value in top)
        lines.append(f"  worst {words}: {cells or 'none'}")
    return lines


def parity_start(runs: Sequence[Run]) -> int:
    """The first step the parity verdict judges a pair of runs from: after each one's LR
    warm-up (its flags) and the first tenth of the shorter (a third run, however short, moves
    no other pair's start)."""
    last = min(run.last_step for run in runs)
    return parity.judged_from([(run.info or {}).get("flags") for run in runs], last)


def main(argv: Sequence[str] | None = None, options: Options | None = None) -> int:
    """The command's output; a caller that knows what to compare (make demo) passes `options`."""
    try:
        options = options or parse_args(argv)
        report = compare(options)
    except Refusal as exc:  # bad input (2), a tracker that failed (1)
        return said("compare_runs.py", exc, exc.exit_code)
    print(report)
    print(f"Wrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
