"""The parity verdict: does a run (FP8) train as well as the reference run (its BF16 twin)?

compare_runs judges each run after the reference (the first run) against it, after the warm-up:
the gap of its smoothed train loss and of its validation loss, each against a band (the noise
its seed **replicas** span, ``NOISE_FACTOR`` x their widest gap; without replicas the fixed
``BAND``, and it says so); the **step lag** at each reference validation, with the band in the
reference's own steps; the loss at matched wall-clock time and the speed to the same loss; a
**trend** (a least-squares slope, reported, never a verdict: a slope fitted to a noisy stretch is
no evidence of drift while the gap stays inside the noise); and one **verdict** decided by the
gap at the run's end (the last shared validation, unless the train gap after it, a late jump or
a trend carried it out of its band) and named by it: "is within seed noise of" / "matches"
inside the band, else "is behind ... by N steps (x%)" or "is ahead of". The rule with its
numbers, and why: docs/metrics.md, "The parity verdict".
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: The band of the relative loss gap inside which a run trains the same model as the reference,
#: where no replica measured this model's seed noise.
BAND = 0.01
#: The noise band is this many times the widest replica gap: a run that trains like BF16 is
#: another seed, and its gap exceeds one replica's about half the time (the ratio of two such
#: gaps is heavy-tailed), so the band must be wider than the replicas' own spread.
NOISE_FACTOR = 2.0
#: The verdict reads the train gap over the last third of the judged windows: where the run
#: ends, which is what a user keeps.
TAIL_SHARE = 1 / 3
#: Without validations the last window decides only when it leaves the tail's windows by this
#: many of their standard deviations (a window of a noisy run is outside the band now and then).
JUMP_SIGMAS = 3.0
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
#: The step-lag line names at most this many validations (evenly spread over the run).
MAX_LAGS = 8


@dataclass(frozen=True)
class SameLoss:
    """The run's last validation loss, and where the reference reached it."""

    step: int
    loss: float
    reference_step: float | None  # None: the reference never validated that low
    reference_last: int  # the reference's last validation step
    speed_ratio: float | None = None  # the run's samples/s over the reference's (steps/s)

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
                f"; at {self.speed_ratio:.3f}x its samples/s, {label} reaches that loss "
                f"{share * self.speed_ratio:.2f}x as fast"
            )
        return line


@dataclass(frozen=True)
class Lag:
    """At the reference's validation ``step``: the steps the run needs beyond it to reach the
    reference's loss there (None: not reached by the run's last validation, ``reached_by``)."""

    step: int
    steps: float | None
    reached_by: int

    def words(self) -> str:
        if self.steps is None:
            return f"{self.step} >{self.reached_by - self.step} (not reached)"
        steps = round(self.steps) or 0  # never "-0"
        return f"{self.step} {steps:+d} ({round(steps / self.step, 2) or 0.0:+.0%})"


@dataclass(frozen=True)
class Noise:
    """The half-width of the band each gap is judged against, by step; ``replicas`` 0: the
    fixed ``BAND`` everywhere (no noise estimate)."""

    replicas: int = 0
    train: Mapping[int, float] = field(default_factory=dict)
    val: Mapping[int, float] = field(default_factory=dict)
    too_short: int = 0  # replicas given that logged no whole window in the judged steps

    def at(self, kind: str, step: int) -> float:
        """The band of ``kind`` ("train" or "val") at ``step``: linear between the steps the
        replicas logged (a replica may log less often than the run), the first one's before
        them; ``BAND`` past their last step, where they measured nothing."""
        band = getattr(self, kind)
        if not self.measured(kind, [step]) or step in band:  # once per judged step: no sort
            return band.get(step, BAND)
        between = loss_at_step(band, step)
        return band[min(band)] if between is None else between

    def measured(self, kind: str, steps: Sequence[int]) -> bool:
        band = getattr(self, kind)
        return bool(self.replicas and band) and max(steps) <= max(band)

    def words(self) -> str:
        if self.replicas:
            return f"seed noise of {self.replicas} replica(s) x{NOISE_FACTOR:g}"
        return f"fixed band ±{BAND:.0%}: no noise estimate"


@dataclass(frozen=True)
class Gap:
    """A gap the verdict may be decided by: in words, its value, the band it is judged against,
    and whether the replicas measured that band (else the fixed ``BAND`` stood in)."""

    words: str
    value: float
    band: float
    measured: bool = False


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
    left_band_step: int | None = None  # first judged step outside, on the verdict's side
    tail: Gap | None = None  # the mean train gap of the last windows
    after: Gap | None = None  # the train gap after the last validation (none: a late jump's)
    val_mean: float | None = None
    val_largest: float | None = None
    val_left_band_step: int | None = None
    val_last: Gap | None = None  # the gap at the last shared validation
    slope: float | None = None  # per 1,000 steps
    slope_error: float | None = None
    window: int = SMOOTHING_STEPS
    noise: Noise = Noise()
    lags: tuple[Lag, ...] = ()
    lag_band: tuple[float, float | None, int] | None = None  # band, its steps, the first val step
    matched_time: tuple[float, float] | None = None  # the reference's step, the val gap there
    same_loss: SameLoss | None = None
    diverged: int | None = None  # the first step whose loss the run logged as NaN, inf or null
    reference_diverged: int | None = None  # the same of the reference

    @property
    def judged(self) -> bool:
        return self.points >= MIN_POINTS

    @property
    def grows(self) -> bool:
        """A significant, material trend away from zero: reported, never a verdict alone."""
        if self.slope is None or self.slope_error is None or self.train_mean is None:
            return False
        significant = abs(self.slope) > TREND_SIGMAS * self.slope_error
        outward = self.slope * self.train_mean > 0 or abs(self.train_mean) < BAND / 10
        material = abs(self.slope) * (self.last - self.first) / 1000 >= MATERIAL_SHARE * BAND
        return significant and outward and material

    @property
    def end(self) -> Gap | None:
        """The gap that decides: the train gap after the last shared validation (without one,
        of the last window) where it left its band (a late divergence no validation saw), else
        that validation's (a mean over many sequences), else the mean train gap of the last
        windows."""
        if self.after is not None and abs(self.after.value) > self.after.band:
            return self.after
        return self.val_last or self.tail

    @property
    def standing(self) -> str:
        """ "within", "behind" or "ahead", by :attr:`end`."""
        end = self.end
        if end is None or abs(end.value) <= end.band:
            return "within"
        return "behind" if end.value > 0 else "ahead"

    @property
    def matches(self) -> bool:
        return self.judged and self.standing == "within" and self.diverged is None

    def lines(self) -> list[str]:
        """The figures, then the verdict line."""
        head = f"Parity of {self.label} with {self.reference}"
        if self.points:
            head += f", steps {self.first}-{self.last}"
        if not self.judged:
            return [
                f"{head}: not judged: {self.points} train step(s) logged by both runs after "
                f"step {self.first} (needs {MIN_POINTS}); train longer, or log both at the "
                "same steps more often (one --logging_freq)",
                *([f"  verdict: {self.verdict()}"] if self.diverged is not None else []),
            ]
        trend = " (a trend)" if self.grows else ""
        lines = [
            f"{head} ({self.points} logged steps, train loss averaged over {self.window} "
            f"steps, {self.noise.words()}):",
            f"  train loss gap: mean {_pct(self.train_mean)}, largest {_pct(self.train_largest)} "
            f"at step {self.train_largest_step}; trend {_pct(self.slope)} "
            f"± {_pct(self.slope_error, sign=False)} per 1,000 steps{trend}",
        ]
        if self.val_mean is not None:
            lines.append(
                f"  validation loss gap: mean {_pct(self.val_mean)}, largest "
                f"{_pct(self.val_largest)}"
            )
        else:
            lines.append("  validation loss gap: no validation step shared by both runs")
        if self.lags:
            lines.append(f"  step lag at {self.reference}'s validations: " + self._lag_words())
        if self.matched_time is not None:
            step, gap = self.matched_time
            lines.append(
                f"  matched time: at its last validation, {self.label}'s loss is {_pct(gap)} from "
                f"{self.reference}'s at step {step:.0f}, where it is in the same wall-clock time"
            )
        if self.same_loss is not None:
            lines.append(self.same_loss.line(self.label, self.reference))
        if self.noise.too_short:
            lines.append(
                f"  noise: no seed-noise estimate, the fixed ±{BAND:.0%} band: the "
                f"{self.noise.too_short} replica(s) logged no whole {self.window}-step window "
                f"from step {self.first}: train them as long as the run"
            )
        elif not self.noise.replicas:
            lines.append(f"  noise: {NO_NOISE}")
        lines.append(f"  verdict: {self.verdict()}")
        return lines

    def _lag_words(self) -> str:
        picked = self.lags[:: max(1, math.ceil(len(self.lags) / MAX_LAGS))]
        if picked[-1] != self.lags[-1]:
            picked = (*picked[:-1], self.lags[-1])
        return ", ".join(lag.words() for lag in picked) + self._lag_band_words()

    def _lag_band_words(self) -> str:
        if self.lag_band is None:
            return ""
        (band, steps, first), step = self.lag_band, self.lags[-1].step
        span = f"more than the {step - first} steps"
        if steps is not None:  # between two validations far apart it can be under one step
            count = f"the {steps:.0f} steps" if steps >= 1 else "less than the one step"
            span = f"{count} ({steps / step:.0%})"
        band_words = f"the band there (±{band:.2%})"
        return f"; {band_words} is {self.reference}'s fall over {span} before step {step}"

    def verdict(self) -> str:
        if self.diverged is not None:  # what the finite steps before it say is beside the point
            return f"{self.label} diverged: its {NOT_FINITE} at step {self.diverged}"
        end, standing = self.end, self.standing
        words = {"within": "matches", "behind": "is behind", "ahead": "is ahead of"}[standing]
        if standing == "within" and end.measured:
            words = "is within seed noise of"
        head = f"{self.label} {words} {self.reference} over steps {self.first}-{self.last}: "
        if standing == "within":
            return f"{head}{end.words} is inside ±{end.band:.2%}{self._notes(end)}"
        left = self.val_left_band_step if end is self.val_last else self.left_band_step
        since = f" (first outside at step {left})" if left is not None else ""
        return f"{head}{self._by(standing)}{end.words} is outside ±{end.band:.2%}{since}" + (
            self._notes(end)
        )

    def _by(self, standing: str) -> str:
        """By how many steps, from the last known step lag, where its sign agrees."""
        lag = next((g for g in reversed(self.lags) if g.steps is not None), None)
        if lag is None or round(lag.steps * (1 if standing == "behind" else -1)) <= 0:
            return ""
        steps = abs(lag.steps)
        return f"by {steps:.0f} steps ({steps / lag.step:.0%}) at step {lag.step}, "

    def _notes(self, end: Gap) -> str:
        """What bounds the verdict: a band the replicas did not measure, a reference that
        diverged."""
        notes = []
        if self.noise.replicas and not end.measured:
            notes.append("the fixed band: the replicas' own runs do not reach these steps")
        if self.reference_diverged is not None:
            notes.append(f"{self.reference}'s own {NOT_FINITE} at step {self.reference_diverged}")
        return f" ({'; '.join(notes)})" if notes else ""


NOT_FINITE = "loss or grad norm is not finite"
#: What a verdict without replicas says about its band, and how to get a noise estimate.
NO_NOISE = (
    f"no seed-noise estimate, the fixed ±{BAND:.0%} band; for one, train the reference again "
    "with another --seed and the same --data_seed (e.g. --seed 43 --data_seed 42) and give it "
    "second, with --replicas 2"
)


def _pct(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.2%}" if sign else f"{value:.2%}"


def judged_from(flags: Sequence[Mapping[str, Any] | None], last_step: int) -> int:
    """The first judged step: after every run's LR warm-up and the run's first ``EARLY_SHARE``."""
    warmups = [int(f.get("warmup") or 0) for f in flags if f]
    return max([*warmups, math.ceil(EARLY_SHARE * last_step)])


#: Each record kind's loss field.
LOSS_KEYS = {"train": "loss", "val": "val_loss"}


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _losses(records: Sequence[Mapping[str, Any]], kind: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if r["kind"] == kind and _finite(r.get(key))}


def smoothed(
    losses: Mapping[int, float], steps: Sequence[int], window: int = SMOOTHING_STEPS
) -> list[float]:
    """At each step, the mean of the losses logged in the ``window`` steps up to it (prefix
    sums over the logged steps: linear in the run's length)."""
    logged = sorted(losses)
    sums = [0.0, *itertools.accumulate(losses[step] for step in logged)]
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
    """The step from which ``validations`` (step -> loss), linear between its steps, stays at
    or below ``loss`` (a run that touched it and rose again has not reached it); None where
    its last validation is above it, or its first is already below it."""
    points = sorted(validations.items())
    if not points or points[-1][1] > loss:
        return None
    for (s0, l0), (s1, l1) in reversed(list(itertools.pairwise(points))):
        if l0 > loss:  # the last validation above it: the curve falls to it after
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return float(points[0][0]) if points[0][1] == loss else None


def loss_at_step(validations: Mapping[int, float], step: float) -> float | None:
    """``validations`` (step -> loss) read at ``step``, linear between its steps (None: outside
    them)."""
    points = sorted(validations.items())
    for (s0, l0), (s1, l1) in zip(points, points[1:], strict=False):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return points[0][1] if points and points[0][0] == step else None


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


def step_lags(mine: Mapping[int, float], theirs: Mapping[int, float], first: int) -> list[Lag]:
    """At each reference validation from ``first`` to the run's last, the steps the run needs
    beyond it to reach the reference's loss there. Left out: losses the run was already below
    at its first validation (how much earlier it got there is not recorded)."""
    if len(mine) < 2:
        return []
    start, last = min(mine), max(mine)
    lags = []
    for step in sorted(s for s in theirs if first <= s <= last):
        if mine[start] <= theirs[step]:
            continue
        reached = step_at_loss(mine, theirs[step])
        lags.append(Lag(step, None if reached is None else reached - step, last))
    return lags


def band_in_steps(theirs: Mapping[int, float], step: int, band: float) -> float | None:
    """The steps the reference took to fall by ``band`` (relative) to its loss at ``step``: a
    run that far behind it there has a gap of ``band`` (None: its first validation was already
    within ``band`` of that loss)."""
    before = {s: loss for s, loss in theirs.items() if s <= step}
    earlier = step_at_loss(before, theirs[step] * (1 + band))
    return None if earlier is None else step - earlier


def matched_time(
    mine: Mapping[int, float], theirs: Mapping[int, float], speed_ratio: float | None
) -> tuple[float, float] | None:
    """The run's last validation loss against the reference's at the step the reference
    reaches in the same wall-clock time (None: no speed ratio, or that step not validated
    around)."""
    if not mine or not speed_ratio:
        return None
    step = max(mine)
    reference_step = step / speed_ratio
    reference = loss_at_step(theirs, reference_step)
    if reference is None:
        return None
    return reference_step, (mine[step] - reference) / reference


@dataclass(frozen=True)
class Gaps:
    """A run's relative gaps to the reference over the judged steps: train (smoothed, at the
    steps whose window is whole) and validation (at the steps both validated)."""

    steps: list[int]  # the judged steps both runs logged
    window: int
    whole: list[int]
    train: list[float]
    val_steps: list[int]
    val: list[float]


def gaps_of(
    run: Sequence[Mapping[str, Any]],
    reference: Sequence[Mapping[str, Any]],
    first: int,
    window: int | None = None,
) -> Gaps:
    """``run``'s gaps to ``reference`` from step ``first`` on; ``window`` None: the run's own
    (``smoothing_window``). Each mean is over judged steps only."""
    mine, theirs = _losses(run, "train", "loss"), _losses(reference, "train", "loss")
    steps = sorted(s for s in mine.keys() & theirs.keys() if s >= first)
    if window is None:
        window = smoothing_window(steps[0], steps[-1]) if steps else 1
    whole = [s for s in steps if s >= steps[0] + window - 1]
    judged_mine, judged_theirs = {s: mine[s] for s in steps}, {s: theirs[s] for s in steps}
    pairs = zip(
        smoothed(judged_mine, whole, window), smoothed(judged_theirs, whole, window), strict=True
    )
    val_mine, val_theirs = _losses(run, "val", "val_loss"), _losses(reference, "val", "val_loss")
    val_steps = sorted(s for s in val_mine.keys() & val_theirs.keys() if s >= first)
    return Gaps(
        steps,
        window,
        whole,
        [(m - t) / t for m, t in pairs],
        val_steps,
        [(val_mine[s] - val_theirs[s]) / val_theirs[s] for s in val_steps],
    )


def _band(by_step: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """``NOISE_FACTOR`` x the widest replica gap at each step, floored at ``NOISE_FACTOR`` x the
    replicas' mean gap size."""
    sizes = [abs(g) for gaps in by_step for g in gaps.values()]
    if not sizes:
        return {}
    floor = sum(sizes) / len(sizes)
    steps = {s for gaps in by_step for s in gaps}
    widest = {s: max(abs(gaps.get(s, 0.0)) for gaps in by_step) for s in steps}
    return {s: NOISE_FACTOR * max(w, floor) for s, w in widest.items()}


def noise_band(
    replicas: Sequence[Sequence[Mapping[str, Any]]],
    reference: Sequence[Mapping[str, Any]],
    first: int,
    window: int,
) -> Noise:
    """The band the replicas' own gaps to the reference span (``Noise()``: no replicas)."""
    found = [gaps_of(r, reference, first, window) for r in replicas]
    short = sum(not g.whole for g in found)
    found = [g for g in found if any(g.train)]  # a copy of the reference measures no noise
    if not found:
        return Noise(too_short=short)
    train = _band([dict(zip(g.whole, g.train, strict=True)) for g in found])
    val = _band([dict(zip(g.val_steps, g.val, strict=True)) for g in found])
    return Noise(len(found), train, val)


def first_not_finite(records: Sequence[Mapping[str, Any]]) -> int | None:
    """The first step whose loss a run logged as NaN, inf or null, or whose grad norm its
    record names non-finite (None: none)."""
    kinds = [r for r in records if r["kind"] in LOSS_KEYS]
    bad = [
        r["step"]
        for r in kinds
        if not _finite(r.get(LOSS_KEYS[r["kind"]])) or "grad_norm" in r.get("not_finite", ())
    ]
    return min(bad, default=None)


def _first_outside(steps, gaps, noise: Noise, kind: str, side: int) -> int | None:
    """The first step whose gap is outside its band on ``side`` (1: behind, -1: ahead)."""
    return next((s for s, g in zip(steps, gaps, strict=True) if side * g > noise.at(kind, s)), None)


def _gap(noise: Noise, kind: str, steps: Sequence[int], values: Sequence[float], where: str) -> Gap:
    """The mean gap of ``kind`` over ``steps`` against their mean band."""
    value, band = sum(values) / len(values), sum(noise.at(kind, s) for s in steps) / len(steps)
    what = "train" if kind == "train" else "validation"
    return Gap(
        f"the {what} loss gap {_pct(value)} {where}", value, band, noise.measured(kind, steps)
    )


def _jumped(windows: Sequence[float]) -> bool:
    """Whether the last window's gap leaves the mean of ``windows`` by more than ``JUMP_SIGMAS``
    times their spread: a late jump, not one noisy window among many."""
    mean = sum(windows) / len(windows)
    spread = math.sqrt(sum((w - mean) ** 2 for w in windows) / len(windows))
    return abs(windows[-1] - mean) > JUMP_SIGMAS * spread


def _ends(gaps: Gaps, noise: Noise) -> tuple[Gap | None, Gap | None, Gap]:
    """The gaps a verdict may be decided by: at the last shared validation, over the train
    windows after it (the last window alone where it jumped), over the last ``TAIL_SHARE`` of the
    train windows."""
    tail = max(1, math.ceil(TAIL_SHARE * len(gaps.whole)))
    last_val, later, where = None, 0, ""
    if gaps.val_steps:
        step = gaps.val_steps[-1]
        last_val = _gap(noise, "val", [step], gaps.val[-1:], f"at step {step}")
        later, where = sum(s > step for s in gaps.whole), f"after the last validation (step {step})"
    if _jumped(gaps.train[-tail:]) and (later or not gaps.val_steps):  # a mean would hide it
        later, where = 1, f"over the last {gaps.window} steps"
    after = _gap(noise, "train", gaps.whole[-later:], gaps.train[-later:], where) if later else None
    where = "over the last judged steps"
    return last_val, after, _gap(noise, "train", gaps.whole[-tail:], gaps.train[-tail:], where)


def judge(
    run: Sequence[Mapping[str, Any]],
    reference: Sequence[Mapping[str, Any]],
    first: int,
    label: str,
    reference_label: str,
    speed_ratio: float | None = None,
    replicas: Sequence[Sequence[Mapping[str, Any]]] = (),
) -> Parity:
    """``run``'s records against ``reference``'s, from step ``first`` on, inside the band the
    ``replicas`` (the reference's seed twins) span; ``speed_ratio`` (the run's tokens/s over the
    reference's) turns the same-loss share into a speed."""
    gaps = gaps_of(run, reference, first)
    steps = gaps.steps
    last = max(steps, default=first)
    diverged = first_not_finite(run)
    if len(steps) < MIN_POINTS:
        return Parity(label, reference_label, first, last, len(steps), diverged=diverged)
    noise = noise_band(replicas, reference, first, gaps.window)
    mine, theirs = _losses(run, "train", "loss"), _losses(reference, "train", "loss")
    slope, error = slope_per_1000(steps, [(mine[s] - theirs[s]) / theirs[s] for s in steps])
    largest = max(range(len(gaps.train)), key=lambda i: abs(gaps.train[i]))
    val_mine, val_theirs = _losses(run, "val", "val_loss"), _losses(reference, "val", "val_loss")
    val_last, after, tail = _ends(gaps, noise)
    lags = tuple(step_lags(val_mine, val_theirs, first))
    lag_band = None
    if lags and min(val_theirs) < lags[-1].step:  # a fall to measure the band in
        band = noise.at("val", lags[-1].step)
        lag_band = (band, band_in_steps(val_theirs, lags[-1].step, band), min(val_theirs))
    found = Parity(
        label,
        reference_label,
        steps[0],
        last,
        len(steps),
        train_mean=sum(gaps.train) / len(gaps.train),
        train_largest=gaps.train[largest],
        train_largest_step=gaps.whole[largest],
        tail=tail,
        after=after,
        val_mean=sum(gaps.val) / len(gaps.val) if gaps.val else None,
        val_largest=max(gaps.val, key=abs) if gaps.val else None,
        val_last=val_last,
        slope=slope,
        slope_error=error,
        window=gaps.window,
        noise=noise,
        lags=lags,
        lag_band=lag_band,
        matched_time=matched_time(val_mine, val_theirs, speed_ratio),
        same_loss=same_loss(val_mine, val_theirs, speed_ratio),
        diverged=diverged,
        reference_diverged=first_not_finite(reference),
    )
    return _decided(found, gaps, noise)


def _decided(found: Parity, gaps: Gaps, noise: Noise) -> Parity:
    """``found`` with the end a marked trend carried out of its band (without validations: the
    mean of the last windows lags a ramp), then the first step outside on the verdict's side."""
    last = _gap(
        noise, "train", gaps.whole[-1:], gaps.train[-1:], f"over the last {gaps.window} steps"
    )
    if found.grows and not gaps.val_steps and abs(last.value) > last.band:
        found = replace(found, after=last)
    side = {"behind": 1, "ahead": -1}.get(found.standing, 0)
    return replace(
        found,
        left_band_step=_first_outside(gaps.whole, gaps.train, noise, "train", side),
        val_left_band_step=_first_outside(gaps.val_steps, gaps.val, noise, "val", side),
    )
