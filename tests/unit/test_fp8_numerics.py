"""--fp8_numerics: the cast figures by hand, the probe on torchao's and TE's (double) linears,
the refusals. Through train.py and compare_runs: tests/integration/test_parity_run.py."""

from __future__ import annotations

import pytest
import torch
from helpers.inprocess import SMALL

from model_utils.config.arguments import parse_args
from model_utils.errors import UsageError
from model_utils.precision import numerics


def cast_figures(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> dict[str, float]:
    """numerics.cast_stats by name, as the probe's take() reads them."""
    return dict(zip(numerics.FIGURES, numerics.cast_stats(x, dtype, scale).tolist(), strict=True))


def test_cast_figures_by_hand() -> None:
    """e4m3 (largest 448, smallest subnormal 2^-9) at scale 1: 1e-4 and -4e-4 are below half
    of 2^-9 and become zero (2e-3 is kept), 500 and -1000 saturate: 2 of 8 values each."""
    x = torch.tensor([0.0, 1e-4, -4e-4, 2e-3, 1.0, 500.0, -1000.0, 3.0])
    got = cast_figures(x, torch.float8_e4m3fn, torch.tensor(1.0))
    assert got == {"amax": 1000.0, "scale": 1.0, "underflow_pct": 25.0, "saturation_pct": 25.0}
    # the dynamic scale maps the amax onto 448: nothing saturates, the small ones underflow
    scale = numerics.amax_scale(torch.float8_e4m3fn)(x)
    assert scale.item() == pytest.approx(448 / 1000)
    assert cast_figures(x, torch.float8_e4m3fn, scale)["saturation_pct"] == 0.0


def test_per_row_scales_report_the_smallest() -> None:
    x = torch.tensor([[1.0, 2.0], [10.0, -40.0]])
    rule = numerics.amax_scale(torch.float8_e4m3fn, per_row=True)
    got = cast_figures(x, torch.float8_e4m3fn, rule(x))
    assert got["scale"] == pytest.approx(448 / 40) and got["saturation_pct"] == 0.0


def fp8_model(recipe: str = "tensorwise"):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    config = Float8LinearConfig.from_recipe_name(recipe)
    import dataclasses

    return convert_to_float8_training(model, config=dataclasses.replace(config, emulate=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_probe_measures_every_fp8_linear_only_when_armed(recipe: str) -> None:
    model = fp8_model(recipe)
    probe = numerics.Probe(model)
    assert probe.linears == ["0", "2"]
    x = torch.randn(8, 32)
    model(x).sum().backward()
    assert probe.take() == {}  # not armed: nothing measured
    probe.armed = True
    model(x).square().sum().backward()
    figures = probe.take()
    assert set(figures) == {"0", "2"} and all(
        set(f) == set(numerics.ROLES) for f in figures.values()
    )
    first = figures["0"]
    assert first["input"]["amax"] == pytest.approx(x.abs().max().item())
    if recipe == "tensorwise":  # torchao's rule: 448 / amax, gradients in e5m2 (57344)
        assert first["input"]["scale"] == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
        grad_amax = first["grad"]["amax"]
        assert first["grad"]["scale"] == pytest.approx(57344 / grad_amax, rel=1e-6)
    else:  # per row, rounded down to a power of 2
        scale = first["input"]["scale"]
        assert scale == 2 ** round(torch.log2(torch.tensor(scale)).item())
    assert probe.take() == {}  # taken


def test_a_scale_too_small_for_the_tensor_shows_as_underflow() -> None:
    """The figure a damaged recipe shows: the same tensor cast with a scale 2^-16 too small."""
    x = torch.randn(4096)
    scale = numerics.amax_scale(torch.float8_e4m3fn)(x)
    healthy = cast_figures(x, torch.float8_e4m3fn, scale)["underflow_pct"]
    damaged = cast_figures(x, torch.float8_e4m3fn, scale * 2**-16)["underflow_pct"]
    assert healthy < 0.1 and damaged > 20


def test_te_linear_delayed_scaling_reports_the_scale_in_fp8_meta(te_double) -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    recipe = te_recipe.DelayedScaling(amax_history_len=4)
    model = torch.nn.Sequential(te.Linear(32, 32), te.Linear(32, 16))
    probe = numerics.Probe(model, recipe)
    probe.armed = True
    x = torch.randn(16, 32, requires_grad=True)
    for _ in range(2):  # the second step casts with the scale the first one's amax set
        with te.autocast(recipe=recipe):
            out = model(x)
        out.sum().backward()
    figures = probe.take()
    meta = model[0].fp8_meta
    assert figures["0"]["input"]["scale"] == meta["scaling_fwd"].scale[0].item() != 1.0
    assert figures["0"]["weight"]["scale"] == meta["scaling_fwd"].scale[1].item()
    assert figures["1"]["grad"]["scale"] == model[1].fp8_meta["scaling_bwd"].scale[0].item()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--fp8=0",), "--fp8_numerics measures FP8 casts: it needs --fp8=1"),
        (("--fp8=1", "--model_impl", "te"), "use --model_impl te_linear"),
        (("--fp8=1", "--model_impl", "te_linear", "--fp8_recipe", "block"), "not --fp8_recipe"),
    ],
    ids=["no-fp8", "fused-te", "te-blocks"],
)
def test_what_the_probe_cannot_read_is_refused(flags, message, te_double) -> None:
    with pytest.raises(UsageError, match=message):
        parse_args([*SMALL, "--fp8_numerics", *flags])


def test_worst_layers_and_the_tracker_summary() -> None:
    figures = {
        "a": {"input": {"underflow_pct": 1.0, "saturation_pct": 0.0}},
        "b": {"grad": {"underflow_pct": 5.0, "saturation_pct": 2.0}},
    }
    assert numerics.worst(figures, "underflow_pct", 1) == [("b", "grad", 5.0)]
    assert numerics.summary_fields(figures) == {
        "input_underflow_pct_max": 1.0,
        "input_saturation_pct_max": 0.0,
        "grad_underflow_pct_max": 5.0,
        "grad_saturation_pct_max": 2.0,
    }
    line = numerics.numerics_line(7, figures)
    assert line == (
        "FP8 numerics at step 7 (2 linears): worst underflow 5.000% (b grad), "
        "worst saturation 2.000% (b grad)"
    )
