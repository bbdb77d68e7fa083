"""The parity verdict: does a run (FP8) train as well as the reference run (its BF16 twin)?

compare_runs prints one per run after the first, judged against the first, after the warm-up:

- the **smoothed train-loss gap**: each run's train loss averaged over the last ``SMOOTHING_STEPS``
  judged steps (fewer in a short run), minus the reference's averaged the same way, relative to
  the reference's; its mean and its largest value, over the steps whose window is whole: a mean
  reaching back into the warm-up would judge the warm-up's steep fall, not the model;
- the **validation-loss gap** at the steps both runs validated (no smoothing: a validation loss
  is already a mean over many sequences);
- the **trend**: the least-squares slope of the per-step relative train-loss gap (unsmoothed, so
  its points are independent enough for the slope's standard error to mean something), per
  1,000 steps, with that standard error;
- the **same loss**: the step at which the reference reached the run's last validation loss
  (linear between the reference's validations), as a share of the run's steps, and times the
  run's speed-up: what FP8 buys to a given loss, not per token;
- one **verdict**: "matches" when both gaps stay inside ``BAND`` and the gap does not grow;
  "drifts" naming where it left the band, or how fast it grows.

Where the numbers come from (docs/metrics.md, "The parity verdict"): ``BAND`` is the ±1% band the
loss-difference panel always drew; published FP8 runs (torchao float8 with FSDP2, NVIDIA's
FP8-formats study) report final losses closer than that. A gap "grows" when its slope is
non-zero by more than ``TREND_SIGMAS`` standard errors, points away from zero, and over the judged
steps amounts to at least ``MATERIAL_SHARE`` of the band: a slope too small to ever matter within
the run is noise about parity, not drift.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The band of the relative loss gap inside which a run trains the same model as the reference.
BAND = 0.01
#: Train losses are averaged over this many steps before the band is applied: the band judges
#: the model, not one batch (both runs read the same batches, so most of it cancels anyway).
SMOOTHING_STEPS = 20
#: A slope is a trend when it is this many standard errors away from zero ...
TREND_SIGMAS = 2.0
#: ... and moves the gap by at least this share of the band over the judged steps.
MATERIAL_SHARE = 0.5
#: Judged from the end of the LR warm-up, and never before this share of the run (the loss's
#: first steep fall, where a one-step lead looks like a large gap).
EARLY_SHARE = 0.1
#: Fewer judged train points than this cannot give a slope with an error.
MIN_POINTS = 4


@dataclass(frozen=True)
class SameLoss:
    """The run's last validation loss, and where the reference reached it."""

    step: int
    loss: float
    reference_step: float | None  # None: the reference never validated that low
    reference_last: int  # the reference's last validation step
    speed_ratio: float | None = None  # the run's tokens/s over the reference's

    def line(self, label: str, reference: str) -> str:
        head = f"  same loss: {label}'s validation loss at step {self.step} ({self.loss:.4f})"
        if self.reference_step is None:
            return (
                f"{head} is below {reference}'s at every validation up to step "
                f"{self.reference_last} (at least {self.reference_last / self.step:.2f}x the "
                "steps)"
            )
        share = self.reference_step / self.step
        line = f"{head} is {reference}'s at step {self.reference_step:.0f} ({share:.2f}x the steps)"
        if self.speed_ratio is not None:
            line += (
                f"; at {self.speed_ratio:.3f}x its tokens/s, {label} reaches that loss "
                f"{share * self.speed_ratio:.2f}x as fast"
            )
        return line


@dataclass(frozen=True)
class Parity:
    """One run against the reference over steps ``first``..``last``; gaps are relative."""

    label: str
    reference: str
    first: int
    last: int
    points: int
    train_mean: float | None = None
    train_largest: float | None = None  # signed, the largest in size
    train_largest_step: int | None = None
    left_band_step: int | None = None  # first judged step whose smoothed gap is outside
    val_mean: float | None = None
    val_largest: float | None = None
    val_left_band_step: int | None = None
    slope: float | None = None  # per 1,000 steps
    slope_error: float | None = None
    window: int = SMOOTHING_STEPS
    same_loss: SameLoss | None = None

    @property
    def judged(self) -> bool:
        return self.points >= MIN_POINTS

    @property
    def grows(self) -> bool:
        if self.slope is None or self.slope_error is None or self.train_mean is None:
            return False
        significant = abs(self.slope) > TREND_SIGMAS * self.slope_error
        outward = self.slope * self.train_mean > 0 or abs(self.train_mean) < BAND / 10
        material = abs(self.slope) * (self.last - self.first) / 1000 >= MATERIAL_SHARE * BAND
        return significant and outward and material

    @property
    def matches(self) -> bool:
        return (
            self.judged
            and self.left_band_step is None
            and self.val_left_band_step is None
            and not self.grows
        )

    def lines(self) -> list[str]:
        """The figures, then the verdict line."""
        head = f"Parity of {self.label} with {self.reference}, steps {self.first}-{self.last}"
        if not self.judged:
            return [
                f"{head}: not judged: {self.points} train step(s) logged by both runs after "
                f"step {self.first} (needs {MIN_POINTS}); train longer or log more often "
                "(--logging_freq)"
            ]
        lines = [
            f"{head} ({self.points} logged steps, train loss averaged over {self.window} "
            f"steps, band ±{BAND:.0%}):",
            f"  train loss gap: mean {_pct(self.train_mean)}, largest {_pct(self.train_largest)} "
            f"at step {self.train_largest_step}; trend {_pct(self.slope)} "
            f"± {_pct(self.slope_error, sign=False)} per 1,000 steps",
        ]
        if self.val_mean is not None:
            lines.append(
                f"  validation loss gap: mean {_pct(self.val_mean)}, largest "
                f"{_pct(self.val_largest)}"
            )
        else:
            lines.append("  validation loss gap: no validation step shared by both runs")
        if self.same_loss is not None:
            lines.append(self.same_loss.line(self.label, self.reference))
        lines.append(f"  verdict: {self.verdict()}")
        return lines

    def verdict(self) -> str:
        span = f"steps {self.first}-{self.last}"
        if self.matches:
            return f"{self.label} matches {self.reference} over {span}"
        if self.left_band_step is not None:
            why = f"the train loss gap left the ±{BAND:.0%} band at step {self.left_band_step}"
        elif self.val_left_band_step is not None:
            why = (
                f"the validation loss gap left the ±{BAND:.0%} band at step "
                f"{self.val_left_band_step}"
            )
        else:
            why = f"the train loss gap grows by {_pct(self.slope)} per 1,000 steps"
        return f"{self.label} drifts from {self.reference} over {span}: {why}"


def _pct(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.2%}" if sign else f"{value:.2%}"


def judged_from(flags: Sequence[Mapping[str, Any] | None], last_step: int) -> int:
    """The first judged step: after every run's LR warm-up and the run's first ``EARLY_SHARE``."""
    warmups = [int(f.get("warmup") or 0) for f in flags if f]
    return max([*warmups, math.ceil(EARLY_SHARE * last_step)])


def _losses(records: Sequence[Mapping[str, Any]], kind: str, key: str) -> dict[int, float]:
    return {
        r["step"]: r[key]
        for r in records
        if r["kind"] == kind and r.get(key) is not None and math.isfinite(r[key])
    }


def smoothed(
    losses: Mapping[int, float], steps: Sequence[int], window: int = SMOOTHING_STEPS
) -> list[float]:
    """At each step, the mean of the losses logged in the ``window`` steps up to it (prefix
    sums over the logged steps: linear in the run's length)."""
    logged = sorted(losses)
    sums = [0.0]
    for step in logged:
        sums.append(sums[-1] + losses[step])
    means = []
    for step in steps:
        low = bisect.bisect_right(logged, step - window)
        high = bisect.bisect_right(logged, step)
        means.append((sums[high] - sums[low]) / (high - low))
    return means


def slope_per_1000(steps: Sequence[int], gaps: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``gaps`` against ``steps`` per 1,000 steps, and its standard
    error (from the residuals, n - 2 degrees of freedom)."""
    n = len(steps)
    mean_x, mean_y = sum(steps) / n, sum(gaps) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, gaps, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(steps, gaps, strict=True))
    error = math.sqrt(residual / (n - 2) / sxx) if n > 2 else math.inf
    return slope * 1000, error * 1000


def smoothing_window(first: int, last: int) -> int:
    """``SMOOTHING_STEPS``, or half the judged steps where fewer than twice that are judged, so
    that a short run still has whole windows to judge."""
    return max(1, min(SMOOTHING_STEPS, (last - first + 1) // 2))


def step_at_loss(validations: Mapping[int, float], loss: float) -> float | None:
    """The first step at which ``validations`` (step -> loss), linear between its steps, falls
    to ``loss``; None where it never does (or ``loss`` is above its first validation)."""
    points = sorted(validations.items())
    for (s0, l0), (s1, l1) in zip(points, points[1:], strict=False):
        if l0 >= loss >= l1:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1) if l0 > l1 else float(s0)
    return None


def same_loss(
    mine: Mapping[int, float], theirs: Mapping[int, float], speed_ratio: float | None
) -> SameLoss | None:
    """Where the reference reached the run's last validation loss (None: nothing to say: too
    few validations, or a loss above the reference's first one)."""
    if not mine or len(theirs) < 2:
        return None
    step = max(mine)
    reference_step = step_at_loss(theirs, mine[step])
    if reference_step is None and mine[step] >= min(theirs.values()):
        return None
    return SameLoss(step, mine[step], reference_step, max(theirs), speed_ratio)


def _first_outside(steps: Sequence[int], gaps: Sequence[float]) -> int | None:
    return next((s for s, g in zip(steps, gaps, strict=True) if abs(g) > BAND), None)


def judge(
    run: Sequence[Mapping[str, Any]],
    reference: Sequence[Mapping[str, Any]],
    first: int,
    label: str,
    reference_label: str,
    speed_ratio: float | None = None,
) -> Parity:
    """``run``'s records against ``reference``'s, from step ``first`` on; ``speed_ratio`` (the
    run's tokens/s over the reference's) turns the same-loss share into a speed."""
    mine, theirs = _losses(run, "train", "loss"), _losses(reference, "train", "loss")
    steps = sorted(s for s in mine.keys() & theirs.keys() if s >= first)
    last = max(steps, default=first)
    if len(steps) < MIN_POINTS:
        return Parity(label, reference_label, first, last, len(steps))
    window = smoothing_window(steps[0], last)
    whole = [s for s in steps if s >= steps[0] + window - 1]  # windows inside the judged steps
    judged_mine, judged_theirs = {s: mine[s] for s in steps}, {s: theirs[s] for s in steps}
    pairs = zip(
        smoothed(judged_mine, whole, window), smoothed(judged_theirs, whole, window), strict=True
    )
    gaps = [(m - t) / t for m, t in pairs]
    largest = max(range(len(gaps)), key=lambda i: abs(gaps[i]))
    slope, error = slope_per_1000(steps, [(mine[s] - theirs[s]) / theirs[s] for s in steps])
    val_mine, val_theirs = _losses(run, "val", "val_loss"), _losses(reference, "val", "val_loss")
    val_steps = sorted(s for s in val_mine.keys() & val_theirs.keys() if s >= first)
    val_gaps = [(val_mine[s] - val_theirs[s]) / val_theirs[s] for s in val_steps]
    return Parity(
        label,
        reference_label,
        steps[0],
        last,
        len(steps),
        train_mean=sum(gaps) / len(gaps),
        train_largest=gaps[largest],
        train_largest_step=whole[largest],
        left_band_step=_first_outside(whole, gaps),
        val_mean=sum(val_gaps) / len(val_gaps) if val_gaps else None,
        val_largest=max(val_gaps, key=abs) if val_gaps else None,
        val_left_band_step=_first_outside(val_steps, val_gaps),
        slope=slope,
        slope_error=error,
        window=window,
        same_loss=same_loss(val_mine, val_theirs, speed_ratio),
    )


def smoothed_gap(
    run: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]]
) -> tuple[list[int], list[float]]:
    """The relative smoothed train-loss gap at every step both runs logged (the picture's)."""
    mine, theirs = _losses(run, "train", "loss"), _losses(reference, "train", "loss")
    steps = sorted(mine.keys() & theirs.keys())
    pairs = zip(smoothed(mine, steps), smoothed(theirs, steps), strict=True)
    return steps, [(m - t) / t for m, t in pairs]
