"""analysis/parity.py: the verdict on curves whose gap is known by construction. A real tiny
pair ("matches") and a pair with FP8 damaged ("is behind"): tests/integration/test_parity_run.py."""

from __future__ import annotations

import math
import random

import pytest

from analysis import parity


def curve(steps: int, gap=lambda step: 0.0, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Train records of a falling loss, times (1 + gap(step)), with relative noise per step."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        loss = (3.0 + 6.0 * math.exp(-step / 60)) * (1 + gap(step)) * (1 + rng.gauss(0, noise))
        records.append({"kind": "train", "step": step, "loss": loss})
    return records


def val(records: list[dict], every: int, gap: float = 0.0) -> list[dict]:
    return [
        {"kind": "val", "step": r["step"], "val_loss": r["loss"] * (1 + gap)}
        for r in records
        if r["step"] % every == 0
    ]


def test_slope_and_its_error_by_hand() -> None:
    assert parity.slope_per_1000([0, 1000, 2000], [0.0, 0.01, 0.02]) == pytest.approx((0.01, 0.0))
    slope, error = parity.slope_per_1000([0, 1, 2, 3], [0.0, 1.0, 0.0, 1.0])
    # y = 0.2 + 0.2x leaves residuals -0.2, 0.6, -0.6, 0.2: sqrt(0.8 / 2 / 5) per step
    assert (slope, error) == pytest.approx((200.0, 1000 * math.sqrt(0.08)))


def test_smoothing_is_the_mean_of_the_last_20_steps() -> None:
    losses = {step: float(step) for step in range(1, 41)}
    assert parity.smoothed(losses, [1, 20, 40]) == [1.0, 10.5, 30.5]
    assert parity.smoothed({10: 4.0, 20: 2.0, 30: 1.0}, [30]) == [1.5]  # logged every 10


def test_a_small_steady_gap_with_noise_matches() -> None:
    bf16 = curve(400, noise=0.003, seed=1)
    fp8 = curve(400, gap=lambda s: 0.002, noise=0.003, seed=2)
    found = parity.judge(fp8 + val(fp8, 50), bf16 + val(bf16, 50), 40, "fp8", "bf16")
    assert found.matches and not found.grows and found.left_band_step is None
    assert found.train_mean == pytest.approx(0.002, abs=0.001)
    assert found.val_mean == pytest.approx(0.002, abs=0.003)
    assert (found.first, found.last, found.points) == (40, 400, 361)
    assert found.lines()[-1] == (
        "  verdict: fp8 matches bf16 over steps 40-400: the validation loss gap "
        f"{found.val_last.value:+.2%} at step 400 is inside ±1.00%"
    )
    assert found.lines()[-2].startswith("  noise: no seed-noise estimate, the fixed ±1% band; ")
    assert "--seed 43 --data_seed 42" in found.lines()[-2] and "--replicas 2" in found.lines()[-2]


def test_a_gap_growing_inside_the_band_is_a_trend_not_a_drift() -> None:
    """The slope is reported, and marked a trend; while the gap stays inside the band at the
    run's end the run matches."""
    bf16 = curve(400, noise=0.002, seed=1)
    fp8 = curve(400, gap=lambda s: 0.015 * s / 1000, noise=0.002, seed=2)  # 0.6% at the end
    found = parity.judge(fp8, bf16, 40, "fp8", "bf16")
    assert found.left_band_step is None and found.grows and found.matches
    assert found.slope == pytest.approx(0.015, abs=0.002)
    assert found.slope > parity.TREND_SIGMAS * found.slope_error
    assert f"trend {found.slope:+.2%} ± " in found.lines()[1]
    assert found.lines()[1].endswith("per 1,000 steps (a trend)")
    assert found.verdict() == (
        f"fp8 matches bf16 over steps 40-400: the train loss gap {found.tail.value:+.2%} over "
        "the last judged steps is inside ±1.00%"
    )


def test_a_steep_noisy_slope_inside_the_band_is_not_a_drift() -> None:
    """A short run's slope from few noisy points, FP8 below the reference the whole way (the
    tiny demo's picture): inside the band, so it matches; a lower loss is never a drift."""
    bf16 = curve(100, noise=0.004, seed=3)
    fp8 = curve(100, gap=lambda s: -0.08 * s / 1000, noise=0.004, seed=4)  # -0.8% at the end
    found = parity.judge(fp8, bf16, 10, "fp8", "bf16")
    assert abs(found.slope) > 0.04 and found.tail.value < 0 and abs(found.tail.value) < parity.BAND
    assert found.standing == "within" and found.matches
    assert "drift" not in " ".join(found.lines())


def test_a_steady_lag_is_behind_by_n_steps() -> None:
    """FP8's loss is BF16's of 10% fewer steps: behind by 11% (1/0.9 - 1) of the steps."""
    bf16, fp8 = curve(400), curve(400)
    ref_val = [{"kind": "val", "step": s, "val_loss": 10 - 0.01 * s} for s in range(50, 401, 50)]
    fp8_val = [{"kind": "val", "step": s, "val_loss": 10 - 0.009 * s} for s in range(50, 401, 50)]
    found = parity.judge(fp8 + fp8_val, bf16 + ref_val, 40, "fp8", "bf16")
    assert found.standing == "behind" and not found.matches
    lags = {lag.step: lag.steps for lag in found.lags}
    # the reference's loss at step s is the run's at s / 0.9
    assert lags[100] == pytest.approx(100 / 0.9 - 100)
    assert lags[350] == pytest.approx(350 / 0.9 - 350)
    assert found.lags[-1].steps is None and found.lags[-1].words() == "400 >0 (not reached)"
    assert found.verdict().startswith(
        f"fp8 is behind bf16 over steps 40-400: by {lags[350]:.0f} steps (11%) at step 350, "
        "the validation loss gap +"
    )
    assert "outside ±1.00%" in found.verdict()
    assert "step lag at bf16's validations: 50 " in "\n".join(found.lines())
    short = [r for r in fp8 + fp8_val if r["step"] <= 200]  # the run stopped at step 200
    lagged = parity.judge(short, bf16 + ref_val, 40, "fp8", "bf16").lags
    assert [lag.step for lag in lagged] == [50, 100, 150, 200]  # none past its last step


def test_a_flat_curve_s_lag_is_read_against_the_band_in_steps() -> None:
    """Late in a run a gap inside the band is many steps: the lag line gives the band in the
    reference's own steps, so a run that matches beside a long lag is not a contradiction."""
    bf16 = curve(400)
    ref = {100: 4.0, 200: 3.2, 300: 3.05, 400: 3.0}
    ref_val = [{"kind": "val", "step": s, "val_loss": v} for s, v in ref.items()]
    fp8_val = [{"kind": "val", "step": s, "val_loss": v * 1.005} for s, v in ref.items()]
    found = parity.judge(bf16 + fp8_val, bf16 + ref_val, 40, "fp8", "bf16")
    assert found.matches
    # bf16 was 1% above its 3.0 of step 400 (3.03) at 300 + 100 * 0.02 / 0.05 = step 340;
    # fp8's 3.05 * 1.005 at 300 falls to bf16's 3.05 at 300 + 100 * 0.01525 / 0.05025 = 330
    assert parity.band_in_steps(ref, 400, 0.01) == pytest.approx(60)
    lag_line = next(line for line in found.lines() if "step lag" in line)
    assert lag_line.endswith(
        "300 +30 (+10%), 400 >0 (not reached); the band there (±1.00%) is bf16's fall over the "
        "60 steps (15%) before step 400"
    )
    # a reference already within the band of its last loss at its first validation
    early = {100: 3.02, 200: 3.01, 300: 3.0}
    assert parity.band_in_steps(early, 300, 0.01) is None
    early_val = [{"kind": "val", "step": s, "val_loss": v} for s, v in early.items()]
    late = [{"kind": "val", "step": s, "val_loss": v * 1.005} for s, v in early.items()]
    lines = parity.judge(bf16 + late, bf16 + early_val, 40, "fp8", "bf16").lines()
    assert any(
        line.endswith("is bf16's fall over more than the 200 steps before step 300")
        for line in lines
    )


def test_a_run_better_than_the_reference_is_ahead() -> None:
    bf16, fp8 = curve(300), curve(300, gap=lambda s: -0.03)
    found = parity.judge(fp8, bf16, 30, "fp8", "bf16")
    assert found.standing == "ahead"
    assert found.verdict().startswith(
        "fp8 is ahead of bf16 over steps 30-300: the train loss gap -3"
    )


def test_replicas_set_the_band_window_by_window() -> None:
    """A 0.5% gap is outside the noise of replicas 0.1% apart, and inside that of replicas 0.4%
    apart (x2); the verdict names the noise, not the fixed band."""
    bf16 = curve(300, noise=0.001, seed=1)
    fp8 = curve(300, gap=lambda s: 0.005, noise=0.001, seed=2)
    close = [curve(300, gap=lambda s: 0.001, noise=0.001, seed=5)]
    wide = [curve(300, gap=lambda s: -0.004, noise=0.001, seed=6)]
    outside = parity.judge(fp8, bf16, 30, "fp8", "bf16", replicas=close)
    assert outside.noise.replicas == 1 and outside.standing == "behind"
    assert outside.tail.band == pytest.approx(2 * 0.001, abs=0.0006)
    inside = parity.judge(fp8, bf16, 30, "fp8", "bf16", replicas=wide)
    assert inside.verdict() == (
        f"fp8 is within seed noise of bf16 over steps 30-300: the train loss gap "
        f"{inside.tail.value:+.2%} over the last judged steps is inside ±{inside.tail.band:.2%}"
    )
    assert "seed noise of 1 replica(s) x2" in inside.lines()[0]
    assert not any(line.startswith("  noise:") for line in inside.lines())


def test_a_replica_that_logs_less_often_sets_the_same_band() -> None:
    """The band between a replica's logged steps is read off its neighbours, not the fixed one:
    a replica logging every 10th step judges like one logging every step."""
    bf16, fp8 = curve(200), curve(200, gap=lambda s: 0.006)
    every = curve(200, gap=lambda s: 0.002)
    sparse = [r for r in every if r["step"] % 10 == 0]
    for replica in (every, sparse):
        found = parity.judge(fp8, bf16, 20, "fp8", "bf16", replicas=[replica])
        assert found.standing == "behind" and found.tail.measured
        assert found.tail.band == pytest.approx(0.004)
    assert parity.Noise(1, {10: 0.002, 20: 0.004}).at("train", 15) == pytest.approx(0.003)
    assert parity.Noise(1, {10: 0.002, 20: 0.004}).at("train", 21) == parity.BAND  # past them


def test_a_replica_too_short_to_judge_says_so() -> None:
    bf16, fp8 = curve(200), curve(200, gap=lambda s: 0.002)
    found = parity.judge(fp8, bf16, 20, "fp8", "bf16", replicas=[curve(20, gap=lambda s: 0.001)])
    assert found.noise.replicas == 0 and found.noise.too_short == 1
    assert "  noise: no seed-noise estimate, the fixed ±1% band: the 1 replica(s) logged no " in (
        "\n".join(found.lines())
    )
    assert "train them as long as the run" in found.lines()[-2]


def test_a_late_jump_after_the_last_validation_is_not_averaged_away() -> None:
    """FP8 +6% over its last 10 steps, validations at 100 and 200 both at 0: behind, as it is
    without validations (the mean of the 50 windows after step 200 would hide it)."""
    bf16, fp8 = curve(250), curve(250, gap=lambda s: 0.06 if s > 240 else 0.0)
    for extra in ((val(fp8, 100), val(bf16, 100)), ([], [])):
        found = parity.judge(fp8 + extra[0], bf16 + extra[1], 25, "fp8", "bf16")
        assert found.standing == "behind", found.lines()
        assert "over the last 20 steps is outside" in found.verdict()


def test_a_grad_norm_train_py_stopped_at_is_a_divergence() -> None:
    """train.py stops on a non-finite grad norm with the loss still finite; the record names
    it (``not_finite``), and the verdict is the divergence, not the finite steps before it."""
    bf16, fp8 = curve(100), curve(50)
    fp8[-1] = {**fp8[-1], "grad_norm": None, "not_finite": ["grad_norm"]}
    found = parity.judge(fp8, bf16, 10, "fp8", "bf16")
    assert found.verdict() == "fp8 diverged: its loss or grad norm is not finite at step 50"
    assert parity.judge(fp8[:-1], bf16, 10, "fp8", "bf16").diverged is None
    once = [{"kind": "val", "step": 100, "val_loss": 3.0}]  # one validation: no fall to measure
    later = [{"kind": "val", "step": s, "val_loss": 3.1 - s / 1000} for s in (50, 100)]
    assert parity.judge(bf16 + later, bf16 + once, 10, "a", "b").lag_band is None


def test_a_crossing_of_the_replicas_does_not_pinch_the_band() -> None:
    band = parity._band([{10: 0.004, 20: 0.0, 30: -0.002}])
    assert band == pytest.approx({10: 0.008, 20: 0.004, 30: 0.004})


def test_matched_time_reads_the_reference_where_it_is_in_the_same_time() -> None:
    """At 1.25x the speed, the run's step 200 is the reference's step 160."""
    theirs = {100: 5.0, 200: 4.0}
    mine = {100: 5.1, 200: 4.2}
    step, gap = parity.matched_time(mine, theirs, 1.25)
    assert step == pytest.approx(160) and gap == pytest.approx(4.2 / 4.4 - 1)
    assert parity.matched_time(mine, theirs, None) is None
    assert parity.loss_at_step(theirs, 250) is None


def test_a_gap_that_leaves_the_band_is_named_where_it_left() -> None:
    bf16 = curve(400)
    fp8 = curve(400, gap=lambda s: 0.03 if s > 200 else 0.0)
    found = parity.judge(fp8, bf16, 40, "fp8", "bf16")
    # the 20-step mean crosses 1% once 7 of its 20 steps carry the 3%: step 207
    assert found.left_band_step == 207 and found.train_largest == pytest.approx(0.03)
    assert found.standing == "behind" and "(first outside at step 207)" in found.verdict()


def test_a_validation_gap_outside_the_band_is_behind_though_train_matches() -> None:
    bf16, fp8 = curve(200), curve(200, gap=lambda s: 0.001)
    found = parity.judge(fp8 + val(fp8, 50, gap=0.02), bf16 + val(bf16, 50), 20, "a", "b")
    assert found.left_band_step is None and found.val_left_band_step == 50
    assert "the validation loss gap +2.10% at step 200 is outside ±1.00%" in found.verdict()
    assert found.verdict().startswith("a is behind b over steps 20-200: by ")


def test_noise_alone_is_not_a_trend() -> None:
    for seed in range(5):
        found = parity.judge(curve(300, noise=0.004, seed=seed), curve(300), 30, "a", "b")
        assert not found.grows, (seed, found.slope, found.slope_error)


def test_too_few_shared_steps_are_not_judged() -> None:
    found = parity.judge(curve(10), curve(10), 8, "fp8", "bf16")
    assert not found.judged and not found.matches
    [line] = found.lines()
    assert "not judged: 3 train step(s)" in line and "--logging_freq" in line


@pytest.mark.parametrize("bad", [None, math.nan, math.inf], ids=["null", "nan", "inf"])
def test_a_run_whose_loss_stops_being_finite_diverged_whatever_came_before(bad) -> None:
    """A run that matched until its loss became NaN (train.py stops there, logging null) has
    diverged: the finite steps before it do not make it "match"; a val loss counts too."""
    bf16, fp8 = curve(400, noise=0.003, seed=1), curve(400, noise=0.003, seed=2)
    fp8[299]["loss"] = bad  # step 300
    found = parity.judge(fp8[:300], bf16 + val(bf16, 50), 40, "fp8", "bf16")
    assert found.diverged == 300 and found.standing == "within" and not found.matches
    assert found.lines()[-1] == (
        "  verdict: fp8 diverged: its loss or grad norm is not finite at step 300"
    )
    early = [*fp8[:10], {"kind": "val", "step": 10, "val_loss": bad}]
    found = parity.judge(early, bf16, 8, "fp8", "bf16")  # too short to judge, not too short to say
    assert not found.judged and found.lines()[-1].endswith("not finite at step 10")


def test_judged_from_the_warm_up_or_the_first_tenth() -> None:
    assert parity.judged_from([{"warmup": 200}, {"warmup": 100}], 1000) == 200
    assert parity.judged_from([{"warmup": 2}, None], 50) == 5
    assert parity.judged_from([None, None], 7) == 1


def test_the_warm_up_s_fall_is_not_averaged_into_the_judged_gap() -> None:
    """A 5% gap before the judged start (the steep first fall) leaves no trace: each mean is
    over judged steps only, from the first whole window on. Averaged into the first windows,
    it put the GPU pair outside the band at its first judged step."""
    bf16 = curve(300)
    fp8 = curve(300, gap=lambda s: 0.05 if s < 40 else 0.002)
    found = parity.judge(fp8, bf16, 40, "fp8", "bf16")
    assert found.window == 20 and found.left_band_step is None and found.matches
    assert found.train_largest == pytest.approx(0.002) and found.train_largest_step >= 59


def test_a_short_run_smooths_over_half_its_judged_steps() -> None:
    assert parity.smoothing_window(2, 20) == 9
    assert parity.smoothing_window(40, 400) == parity.SMOOTHING_STEPS
    assert parity.smoothing_window(5, 5) == 1


def test_the_step_at_a_loss_is_read_between_validations() -> None:
    validations = {25: 6.5, 50: 5.2, 75: 5.0}
    assert parity.step_at_loss(validations, 5.25) == pytest.approx(25 + 25 * 1.25 / 1.3)
    assert parity.step_at_loss(validations, 5.0) == pytest.approx(75)
    assert parity.step_at_loss(validations, 6.6) is None  # above the first validation
    assert parity.step_at_loss(validations, 4.9) is None  # never reached


def test_same_loss_says_how_much_faster_fp8_reaches_the_reference_s_loss() -> None:
    """FP8 at 1.2x the tokens/s needs 200 steps for the loss BF16 had at 175: 1.05x to it."""
    bf16 = curve(200)
    fp8 = curve(200, gap=lambda s: 0.01)
    ref_val = val(bf16, 25)
    later = {r["step"]: r["val_loss"] for r in ref_val}
    mine = [{"kind": "val", "step": 200, "val_loss": later[175]}]  # bf16's loss at step 175
    found = parity.judge(fp8 + mine, bf16 + ref_val, 20, "fp8", "bf16", speed_ratio=1.2)
    assert found.same_loss.reference_step == pytest.approx(175)
    assert found.lines()[-3] == (
        f"  same loss: fp8's validation loss at step 200 ({later[175]:.4f}) is bf16's at step "
        "175 (0.88x the steps); at 1.200x its samples/s, fp8 reaches that loss 1.05x as fast"
    )
    better = [{"kind": "val", "step": 200, "val_loss": later[200] * 0.99}]
    found = parity.judge(fp8 + better, bf16 + ref_val, 20, "fp8", "bf16")
    assert "is below bf16's at every validation up to step 200 (at least 1.00x" in str(
        found.lines()
    )
    assert parity.judge(fp8, bf16 + ref_val, 20, "fp8", "bf16").same_loss is None  # no val


def test_a_loss_touched_and_left_again_is_not_reached() -> None:
    """The lag counts from where a curve falls to a loss and stays there: a run that dips
    below the reference's loss and rises above it again has not reached it."""
    assert parity.step_at_loss({100: 5.0, 200: 4.0, 300: 4.5}, 4.2) is None
    assert parity.step_at_loss({100: 5.0, 200: 4.0, 300: 4.5, 400: 3.5}, 4.2) == 330
    assert parity.step_at_loss({100: 4.2, 200: 4.0}, 4.2) == 100


def test_a_run_that_ends_behind_is_never_behind_by_a_lead() -> None:
    """2% better until step 350, then 2% worse: behind at the end, with no "by N steps" from
    the run's earlier lead and the first step outside on the behind side, not the lead's."""
    gap = lambda s: -0.02 if s <= 350 else 0.02  # noqa: E731
    bf16, fp8 = curve(400), curve(400, gap=gap)
    found = parity.judge(fp8 + val(fp8, 50), bf16 + val(bf16, 50), 40, "fp8", "bf16")
    assert found.standing == "behind" and found.lags[-1].steps is None
    assert found.verdict() == (
        "fp8 is behind bf16 over steps 40-400: the validation loss gap +2.00% at step 400 is "
        "outside ±1.00% (first outside at step 400)"
    )
    turned = parity.judge(curve(400, gap=lambda s: 0.02 if s <= 200 else -0.02), bf16, 40, "a", "b")
    assert turned.standing == "ahead" and turned.left_band_step > 200


def test_a_divergence_after_the_last_validation_is_behind() -> None:
    """A train gap that leaves the band after the last validation decides: no validation saw
    it, the train loss did."""
    bf16 = curve(400)
    fp8 = curve(400, gap=lambda s: 0.0 if s <= 350 else 0.002 * (s - 350))  # +10% at 400
    found = parity.judge(fp8 + val(fp8, 50)[:-1], bf16 + val(bf16, 50), 40, "fp8", "bf16")
    assert found.val_last.value == pytest.approx(0.0) and found.standing == "behind"
    assert "after the last validation (step 350) is outside ±1.00%" in found.verdict()
    calm = parity.judge(bf16 + val(bf16, 50)[:-1], bf16 + val(bf16, 50), 40, "a", "b")
    assert calm.matches and "at step 350 is inside" in calm.verdict()


def test_a_late_jump_in_a_run_without_validation_is_behind() -> None:
    """Without validations the last window's train gap decides where it left its band: the
    mean over the last third (+0.3% here) would call a run that ends +2% behind a match."""
    bf16 = curve(400)
    fp8 = curve(400, gap=lambda s: 0.0 if s <= 380 else 0.002 * (s - 380))  # +4% at 400
    found = parity.judge(fp8, bf16, 40, "fp8", "bf16")
    assert abs(found.tail.value) < parity.BAND < found.after.value
    assert found.standing == "behind" and not found.matches
    assert "the train loss gap +2.10% over the last 20 steps is outside ±1.00%" in found.verdict()
    calm = parity.judge(fp8[:-20], bf16[:-20], 40, "fp8", "bf16")  # the run before the jump
    assert calm.matches and "over the last judged steps is inside" in calm.verdict()
    jump = lambda s: 0.0 if s <= 380 else 0.002 * (s - 380)  # noqa: E731
    noisy = curve(400, gap=jump, noise=0.005, seed=3), curve(400, noise=0.005, seed=4)
    assert parity.judge(*noisy, 40, "fp8", "bf16").standing == "behind"
    # One noisy window outside the band is no jump: two runs alike but for 2% noise a step.
    alike = curve(400, noise=0.02, seed=10), curve(400, noise=0.02, seed=1010)
    assert parity.judge(*alike, 40, "fp8", "bf16").matches


def test_steps_past_the_replicas_are_judged_by_the_fixed_band_and_say_so() -> None:
    """Replicas of 200 steps measure no noise at step 400: a run that ends +0.5% there is not
    "within seed noise", it matches inside the fixed band, and the verdict says why."""
    bf16 = curve(400, noise=0.0005, seed=1)
    fp8 = curve(400, gap=lambda s: 0.005, noise=0.0005, seed=2)
    short = [curve(200, gap=lambda s: 0.0002, noise=0.0005, seed=3)]
    found = parity.judge(fp8, bf16, 40, "fp8", "bf16", replicas=short)
    assert found.noise.replicas == 1 and not found.tail.measured and found.matches
    assert found.verdict().startswith("fp8 matches bf16 over steps 40-400: the train loss gap +0.")
    assert found.verdict().endswith(
        "is inside ±1.00% (the fixed band: the replicas' own runs do not reach these steps)"
    )


def test_a_replica_identical_to_the_reference_measures_no_noise() -> None:
    """Zero replica gaps would be a zero-width band that calls every run outside: no noise."""
    bf16 = curve(300)
    found = parity.judge(curve(300, gap=lambda s: 0.001), bf16, 30, "a", "b", replicas=[bf16])
    assert found.noise == parity.Noise() and found.matches
    other = curve(300, gap=lambda s: 0.002)
    found = parity.judge(curve(300), bf16, 30, "a", "b", replicas=[bf16, other])
    assert found.noise.replicas == 1  # the one that measured something


def test_a_lag_s_share_is_of_the_steps_it_prints() -> None:
    assert parity.Lag(50, 0.38, 400).words() == "50 +0 (+0%)"
    assert parity.Lag(150, 12.6, 200).words() == "150 +13 (+9%)"
    assert parity.Lag(100, -1.2, 200).words() == "100 -1 (-1%)"


def test_a_reference_that_diverged_is_named_in_the_verdict() -> None:
    bf16, fp8 = curve(400), curve(400)
    bf16[299]["loss"] = math.nan
    found = parity.judge(fp8, bf16[:300], 40, "fp8", "bf16")
    assert found.verdict().endswith("(bf16's own loss or grad norm is not finite at step 300)")


def test_runs_that_end_before_the_judged_start_name_no_span() -> None:
    [line] = parity.judge(curve(3), curve(3), 5, "fp8", "bf16").lines()
    assert line.startswith("Parity of fp8 with bf16: not judged: 0 train step(s)")


def test_runs_that_logged_other_steps_are_told_to_log_the_same_ones() -> None:
    """Every 10th step from 5 against every 10th from 10: many steps each, none in common."""
    bf16 = [r for r in curve(300) if r["step"] % 10 == 5]
    fp8 = [r for r in curve(300) if r["step"] % 10 == 0]
    [line] = parity.judge(fp8, bf16, 30, "fp8", "bf16").lines()
    assert "not judged: 0 train step(s) logged by both runs after step 30" in line
    assert line.endswith("log both at the same steps more often (one --logging_freq)")


def test_a_steady_late_ramp_out_of_the_band_is_behind() -> None:
    """No validations; the gap climbs from 0 at step 134 to +1.9% at 200: the mean of the last
    third is inside the band (+0.9%) and no single window jumped, but the trend carried the
    end out of the band, as the picture shows: behind, not "matches"."""
    ramp = lambda s: 0.0 if s <= 134 else 0.019 * (s - 134) / 66  # noqa: E731
    found = parity.judge(curve(200, gap=ramp), curve(200), 20, "fp8", "bf16")
    assert found.grows and abs(found.tail.value) < parity.BAND
    assert found.standing == "behind"
    assert "the train loss gap +1." in found.verdict()
    assert "over the last 20 steps is outside ±1.00%" in found.verdict()
