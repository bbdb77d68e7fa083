"""compare_runs --tracker: the A/B's comparison as a run of its own in the trackers its runs use
(the same W&B project, MLflow store and experiment, TensorBoard log dir), through the sinks
training writes with (model_utils/report/trackers.py). Its files go to a folder beside the last
run's, ``compare-<run>-vs-<run>``: each run's smoothed train-loss gap to the reference per step
and the band it is judged against, as series the tracker draws; the picture; the report and the
verdict as text. A run is compare_runs.Run."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from analysis.parity import BAND, Noise, Parity, gaps_of
from model_utils.config import flag_rules
from model_utils.errors import Refusal, UsageError, first_line
from model_utils.report.trackers import SINKS, redacted


class Unsent(Refusal):
    """A tracker that failed while the comparison was sent (a server that refuses): one line,
    exit code 1 (the input was good)."""

    exit_code = 1


def tracker_names(spec: str, infos: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """--tracker's names (``runs``: the runs' own, their --tracker and --tensorboard), each known
    and its package importable; else a UsageError, before anything is written."""
    if spec.strip().lower() == "runs":
        used = [(info or {}).get("flags", {}) for info in infos]
        spec = ",".join(
            f"{f.get('tracker') or ''},{'tensorboard' * bool(f.get('tensorboard'))}" for f in used
        )
        if not spec.strip(","):
            raise UsageError("--tracker runs: the runs were trained with no tracker; name one")
    names = flag_rules.tracker_names(spec)
    flag_rules.check_tracker_packages(names)
    return names


def gap_records(
    runs: Sequence[Any], labels: Sequence[str], noise: Noise | None, first: int
) -> list[dict]:
    """``compare`` records, one per step from ``first``: each run's smoothed train-loss gap to
    the first run, in % (the picture's gap panel), and the half-width of the band the verdict
    judges it against."""
    by_step: dict[int, dict[str, float]] = {}
    for run, label in zip(runs[1:], labels[1:], strict=True):
        # MLflow's metric names take letters, digits and "_.- /" ("/" would nest W&B's panels).
        key = "train_loss_gap_pct/" + re.sub(r"[^\w.\- ]+", "_", label)
        gaps = gaps_of(run.records, runs[0].records, first)  # the verdict's windows
        for step, gap in zip(gaps.whole, gaps.train, strict=True):
            by_step.setdefault(step, {})[key] = 100 * gap
    for step, values in by_step.items():
        values["band_pct"] = 100 * (noise.at("train", step) if noise else BAND)
    return [{"kind": "compare", "step": step, **by_step[step]} for step in sorted(by_step)]


def send(
    names: Sequence[str],
    runs: Sequence[Any],
    labels: Sequence[str],
    verdicts: Sequence[Parity],
    picture: Path,
    report: str,
) -> list[str]:
    """The comparison in each tracker of `names` (none: nothing), in a folder beside the last
    run's (its log's, for a log): it shares the runs' default MLflow store (runs/mlflow.db), and
    ``tensorboard --logdir runs`` shows it. A line saying where it went; a tracker that fails is
    Unsent, naming it."""
    if not names:
        return []
    last = runs[-1].source.resolve()
    home = last.parent.parent if last.suffix == ".jsonl" else last.parent
    home /= ("compare-" + "-vs-".join(r.fallback_label for r in runs))[:200]  # NAME_MAX 255
    flags = {"runs": ", ".join(str(r.source.resolve()) for r in runs), "labels": ", ".join(labels)}
    comparison = {"kind": "compare", "flags": {**flags, "picture": str(picture.resolve())}}
    first = verdicts[0].first if verdicts else 1
    records = gap_records(runs, labels, verdicts[0].noise if verdicts else None, first)
    verdict = "\n".join(v.lines()[-1].strip().removeprefix("verdict: ") for v in verdicts)
    home.mkdir(exist_ok=True)
    sent = []
    for name in names:
        try:
            sink = SINKS[name](comparison, str(home), None, 0)
            for record in records:
                sink.write(record)
            sink.publish(picture, report, verdict, records[-1]["step"] if records else 0)
            sink.close()
        except Exception as exc:  # the library's own errors: no common base class
            raise Unsent(f"--tracker {name}: {redacted(first_line(exc))}") from exc
        sent.append(f"{name}: run {sink.id}" if sink.id else f"{name}: {home / name}")
    return [f"The comparison in the trackers ({home}): " + "; ".join(sent)]
