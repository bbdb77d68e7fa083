"""--fp8_numerics: the cast figures by hand, the probe on torchao's and TE's (double) linears,
TE's fused layers through TE's debug tools (the real nvdlfw-inspect, the double's TE features),
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
        (("--fp8=1", "--model_impl", "te_linear", "--fp8_recipe", "block"), "not --fp8_recipe"),
        (("--fp8=1", "--model_impl", "te", "--fp8_recipe", "mxfp8"), "not --fp8_recipe mxfp8"),
        (
            ("--fp8=1", "--model_impl", "te", "--fp8_weights", "--master_weights", "optimizer"),
            "--fp8_weights keeps no high-precision weight",
        ),
    ],
    ids=["no-fp8", "te-linear-blocks", "fused-te-blocks", "fused-te-fp8-weights"],
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


# ------------------------------------------------------------------ TE's fused layers (te)


def test_te_statistic_names_become_the_figures() -> None:
    """TE logs ``<layer>_<tensor>_<stat>``; the scale is one over the largest inverse scale, and
    a GEMM TE measured only in high precision (no underflows%) is no FP8 linear."""
    layer = "model.layers.1.transformer_layer.layernorm_mlp.fc2"
    stats = {
        f"{layer}_activation_cur_amax": 3.0,
        f"{layer}_activation_underflows%": 0.5,
        f"{layer}_activation_scale_inv_max": 0.25,
        f"{layer}_gradient_underflows%": 2.0,
        f"{layer}_gradient_scale_inv_max": 0.5,
        f"{layer}_gradient_overflows%": 1.0,
        "model.layers.0.transformer_layer.self_attention.proj_weight_cur_amax": 1.0,
    }
    assert numerics.te_figures(stats) == {
        layer: {
            "grad": {
                "amax": pytest.approx(float("nan"), nan_ok=True),
                "scale": 2.0,
                "underflow_pct": 2.0,
                "saturation_pct": 1.0,
            },
            "input": {"amax": 3.0, "scale": 4.0, "underflow_pct": 0.5, "saturation_pct": 0.0},
        }
    }


def te_run(tmp_path, recipe: str, kept: tuple[int, ...] = (), steps: int = 2):
    """A 2-layer TE Llama built after TE's debug tools started (as TEBackend does for a run),
    trained ``steps`` steps with figures every 2: what each step's take() returned, and the
    delayed-scaling scale the first layer's QKV input was cast with at each step."""
    from helpers.te_models import backend_args, batch, built, tiny_config

    from model_utils.precision.te import TEBackend

    flags = dict(fp8_numerics=True, logging_freq=2, output_dir=str(tmp_path))
    if kept:
        flags["bf16_layers"] = ",".join(map(str, kept))
    backend = TEBackend(backend_args(True, recipe, **flags), numerics=True)
    config = tiny_config()
    model = backend.prepare(built(config))
    backend.debug.begin(0, keep=True)
    taken, scales = [], []
    qkv = model.model.layers[0].transformer_layer.self_attention.layernorm_qkv
    try:
        for step in range(1, steps + 1):
            state = qkv.fp8_meta.get("scaling_fwd")
            scales.append(state.scale[0].item() if hasattr(state, "scale") else None)
            ids = batch(config, seed=step)
            with backend.autocast(first_micro_batch=True):
                loss = model(ids, labels=ids).loss
            loss.backward()
            backend.debug.step_done()
            taken.append(backend.debug.take())
    finally:
        backend.debug.close()
    return taken, scales


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_fused_layers_report_through_te_debug_tools(tmp_path, te_double, recipe) -> None:
    """Every FP8 GEMM of the fused layers (QKV, projection, the MLP's fc1 and fc2) at the
    report step only, with its input's scale the one the recipe cast with: under delayed
    scaling the scale in fp8_meta, under current scaling 448 over the input's own amax."""
    (first, second), (_, scale_used) = te_run(tmp_path, recipe)
    assert first == {}  # step 1 is no report step
    prefix = "model.layers.{}.transformer_layer."
    gemms = ["self_attention.layernorm_qkv", "self_attention.proj", "layernorm_mlp.fc1"]
    gemms.append("layernorm_mlp.fc2")
    assert sorted(second) == sorted(prefix.format(i) + g for i in range(2) for g in gemms)
    for roles in second.values():
        assert set(roles) == set(numerics.ROLES)
        assert all(0 <= f["underflow_pct"] < 100 and f["scale"] > 0 for f in roles.values())
    qkv = second[prefix.format(0) + gemms[0]]["input"]
    if recipe == "delayed":  # the scale step 1's amax set
        assert qkv["scale"] == pytest.approx(scale_used, rel=1e-6) and scale_used != 1.0
    else:
        assert qkv["scale"] == pytest.approx(448 / qkv["amax"], rel=1e-6)
        assert qkv["saturation_pct"] == 0.0
    assert (tmp_path / "fp8_numerics" / "config.yaml").is_file()


def test_layers_kept_in_bf16_are_left_out_and_the_tools_stop_at_close(tmp_path, te_double):
    (_, taken), _ = te_run(tmp_path, "delayed", kept=(0,))
    assert taken and all(name.startswith("model.layers.1.") for name in taken)
    import nvdlfw_inspect.api as debug_api

    assert debug_api.DEBUG_MANAGER is None  # closed: the next run (test) starts them afresh


def test_the_fused_layers_numerics_without_nvdlfw_inspect_are_refused(monkeypatch, te_double):
    """Before any process group: one line naming the package TE's debug tools are."""
    import importlib.util

    from model_utils.precision import te

    config = parse_args([*SMALL, "--fp8_numerics", "--fp8=1", "--model_impl", "te"])
    te.check_requirements(config)  # installed here: no refusal
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "nvdlfw_inspect" else real(name, *a),
    )
    with pytest.raises(UsageError, match="need nvdlfw-inspect .*: pip install nvdlfw-inspect"):
        te.check_requirements(config)
