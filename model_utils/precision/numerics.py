"""FP8 numerics you can see (--fp8_numerics): at report steps, for every FP8 linear, its input,
weight and incoming gradient as the recipe casts them: the amax, the scale, and the share of
values that underflow to zero and that saturate at the format's largest value.

The figures are those of the real cast: each tensor is multiplied by the scale the recipe uses
(torchao: its own ``amax_to_scale`` with the layer's cast config, per tensor or per row; TE
delayed scaling: the scale in the module's ``fp8_meta``, which the amax history set; TE current
scaling: the format's largest value over the tensor's amax), clamped and cast to the format, and
the zeros that were not zeros before are counted. Row-wise scales are reported as their
smallest (the row with the largest amax), the cast's underflow as the share over all rows.

Rank 0 measures its own micro-batches (the last one of a report step) and no other rank does
any work; a step that is not a report step costs one boolean test per linear. TE's fused layers
(--model_impl te) keep their GEMM inputs inside: there TE's own debug tools measure (TeDebug).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_utils.errors import write_whole
from model_utils.parallel.distributed import canonical_param_name

ROLES = ("input", "weight", "grad")
#: A scale rule: the tensor -> the scale it is cast with (a scalar or one per row).
ScaleRule = Callable[[torch.Tensor], torch.Tensor]
#: The value at the amax lands on the format's largest value, give or take fp32's rounding of the
#: product: only what lies beyond that is saturation.
_ROUNDING = 1 + 2**-20

FIGURES = ("amax", "scale", "underflow_pct", "saturation_pct")


def cast_stats(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """What casting ``x`` to ``dtype`` with ``scale`` does, as the four FIGURES in one tensor on
    ``x``'s device (no sync: a report step reads them all at once): amax, scale (the smallest,
    if one per row), and the % of values that become zero and that lie beyond the largest."""
    values = x.detach().float()
    scale = scale.detach().float().to(values.device)
    largest = torch.finfo(dtype).max
    scaled = values * scale
    cast = scaled.clamp(-largest, largest).to(dtype).float()
    count = max(values.numel(), 1)
    amax = values.abs().max() if values.numel() else values.new_zeros(())
    return torch.stack(
        [
            amax,
            scale.min(),
            100.0 * ((cast == 0) & (values != 0)).sum() / count,
            100.0 * (scaled.abs() > largest * _ROUNDING).sum() / count,
        ]
    )


def amax_scale(dtype: torch.dtype, per_row: bool = False, power_of_2: bool = False) -> ScaleRule:
    """Dynamic scaling: the format's largest value over the amax (of each row, if per row),
    through torchao's own function where torchao is present (its rounding and epsilon)."""

    def rule(x: torch.Tensor) -> torch.Tensor:
        values = x.detach().float()
        amax = values.abs().amax(dim=-1, keepdim=True) if per_row else values.abs().max()
        try:
            from torchao.float8.float8_utils import amax_to_scale
        except ImportError:  # TE's current scaling: no epsilon beyond a zero amax
            return torch.finfo(dtype).max / amax.clamp(min=torch.finfo(torch.float32).tiny)
        return amax_to_scale(amax, dtype, power_of_2)

    return rule


def torchao_rules(module: nn.Module) -> dict[str, tuple[torch.dtype, ScaleRule]] | None:
    """A torchao Float8Linear's cast per role, from its config; None for any other module."""
    if type(module).__name__ != "Float8Linear":
        return None
    config = module.config
    casts = {
        "input": config.cast_config_input,
        "weight": config.cast_config_weight,
        "grad": config.cast_config_grad_output,
    }

    def rule(cast: Any) -> ScaleRule:
        per_row = cast.scaling_granularity.value == "axiswise"
        return amax_scale(cast.target_dtype, per_row, config.round_scales_to_power_of_2)

    return {role: (cast.target_dtype, rule(cast)) for role, cast in casts.items()}


def te_rules(module: nn.Module, recipe: Any) -> dict[str, tuple[torch.dtype, ScaleRule]] | None:
    """A te.Linear's cast per role under the run's TE recipe (delayed: the scales in its
    fp8_meta, FP8FwdTensors.GEMM1_INPUT/WEIGHT and FP8BwdTensors.GRAD_OUTPUT1, slots 0, 1, 0;
    current: amax-based); None for any other module."""
    if not hasattr(module, "fp8_meta") or not hasattr(module, "in_features"):
        return None
    backward = torch.float8_e5m2 if recipe.fp8_format.name == "HYBRID" else torch.float8_e4m3fn
    casts = {  # role -> (format, fp8_meta key, slot)
        "input": (torch.float8_e4m3fn, "scaling_fwd", 0),
        "weight": (torch.float8_e4m3fn, "scaling_fwd", 1),
        "grad": (backward, "scaling_bwd", 0),
    }

    def rule(dtype: torch.dtype, key: str, slot: int) -> ScaleRule:
        if not recipe.delayed():
            return amax_scale(dtype)
        return lambda x: module.fp8_meta[key].scale[slot]

    return {role: (dtype, rule(dtype, key, slot)) for role, (dtype, key, slot) in casts.items()}


class Probe:
    """Hooks on the model's FP8 linears that measure while ``armed`` (the report steps):
    ``take()`` returns ``{layer: {role: figures}}`` measured since the last take."""

    def __init__(self, model: nn.Module, te_recipe: Any = None) -> None:
        self.armed = False
        self.figures: dict[tuple[str, str], torch.Tensor] = {}  # (layer, role) -> cast_stats
        self.linears: list[str] = []
        for name, module in model.named_modules():
            rules = torchao_rules(module) if te_recipe is None else te_rules(module, te_recipe)
            if rules is not None:
                self.linears.append(canonical_param_name(name))
                module.register_forward_hook(self._forward_hook(self.linears[-1], rules))

    def _forward_hook(self, name: str, rules: dict[str, tuple[torch.dtype, ScaleRule]]):
        def measure(role: str, tensor: torch.Tensor) -> None:
            dtype, rule = rules[role]
            flat = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor
            self.figures[name, role] = cast_stats(flat, dtype, rule(flat))

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not self.armed:
                return
            with torch.no_grad():
                measure("input", args[0])
                measure("weight", module.weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: measure("grad", grad) if self.armed else None)

        return hook

    def step_done(self) -> None:
        """Nothing to do between steps (TeDebug's tools reduce here)."""

    def close(self) -> None:
        """The hooks go with the model."""

    def take(self) -> dict[str, dict[str, dict[str, float]]]:
        """The figures measured since the last take, read from the device in one copy."""
        figures, self.figures = self.figures, {}
        if not figures:
            return {}
        rows = torch.stack(list(figures.values())).cpu().tolist()
        taken: dict[str, dict[str, dict[str, float]]] = {}
        for (layer, role), row in zip(figures, rows, strict=True):
            taken.setdefault(layer, {})[role] = dict(zip(FIGURES, row, strict=True))
        return taken


def worst(
    figures: dict[str, dict[str, dict[str, float]]], key: str, count: int = 3
) -> list[tuple[str, str, float]]:
    """The ``count`` (layer, role, value) with the largest ``key`` (underflow_pct or
    saturation_pct), largest first."""
    found = [
        (layer, role, values[key])
        for layer, roles in figures.items()
        for role, values in roles.items()
    ]
    return sorted(found, key=lambda item: -item[2])[:count]


def summary_fields(figures: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Per role, the largest underflow and saturation over the layers: the tracker charts."""
    fields: dict[str, float] = {}
    for role in ROLES:
        rows = [roles[role] for roles in figures.values() if role in roles]
        for key in ("underflow_pct", "saturation_pct"):
            if rows:
                fields[f"{role}_{key}_max"] = max(row[key] for row in rows)
    return fields


def numerics_line(step: int, figures: dict[str, dict[str, dict[str, float]]]) -> str:
    """The log's line at a report step: the worst layer for underflow and for saturation."""
    parts = []
    for key, words in (("underflow_pct", "underflow"), ("saturation_pct", "saturation")):
        top = [t for t in worst(figures, key, 1) if t[2] > 0]
        if top:
            layer, role, value = top[0]
            parts.append(f"worst {words} {value:.3f}% ({layer} {role})")
        else:
            parts.append(f"no {words}")
    return f"FP8 numerics at step {step} ({len(figures)} linears): " + ", ".join(parts)


# --------------------------------------------------------------------------------------------
# TE's fused layers (--model_impl te): their GEMM inputs never leave TE's modules, so the figures
# come from TE's own precision-debug tools (nvdlfw-inspect with TE's LogTensorStats and
# LogFp8TensorStats), which measure inside the modules and reduce over the ranks.

#: The debug tools' tensor names -> the roles above.
TE_TENSORS = {"activation": "input", "weight": "weight", "gradient": "grad"}
#: How TE names a statistic for its logger: ``<layer>_<tensor>_<stat>``.
_TE_STAT = re.compile(r"^(?P<layer>.+)_(?P<tensor>activation|weight|gradient)_(?P<stat>.+)$")


def te_debug_config(freq: int, delayed: bool, kept: tuple[int, ...]) -> dict[str, Any]:
    """The debug tools' config: every ``freq`` steps, for each FP8 GEMM's three tensors, the
    amax (LogTensorStats ``cur_amax``), the cast's underflow share and its largest inverse scale
    (LogFp8TensorStats), and under delayed scaling its saturation (``overflows%``: TE offers it
    for that recipe only). Decoder layers kept in BF16 run no FP8 cast and are left out."""
    skip = "|".join(map(str, kept))

    def feature(*stats: str) -> dict[str, Any]:
        return {"enabled": True, "tensors": list(TE_TENSORS), "stats": list(stats), "freq": freq}

    fp8_stats = ("underflows%", "scale_inv_max", *(("overflows%",) if delayed else ()))
    layers = rf"^(?!(.*\.)?layers\.({skip})\.)" if kept else "."
    return {
        "fp8_numerics": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": layers},
            "transformer_engine": {
                "LogTensorStats": feature("cur_amax"),
                "LogFp8TensorStats": feature(*fp8_stats),
            },
        }
    }


def te_figures(stats: dict[str, float]) -> dict[str, dict[str, dict[str, float]]]:
    """TE's named statistics as ``{layer: {role: FIGURES}}``: the scale is the smallest (one over
    the largest inverse scale); current scaling maps each tensor's amax onto the format's largest
    value, so nothing saturates where TE measures no ``overflows%``."""
    by_tensor: dict[tuple[str, str], dict[str, float]] = {}
    for name, value in stats.items():
        found = _TE_STAT.match(name)
        if found:
            key = (found["layer"], TE_TENSORS[found["tensor"]])
            by_tensor.setdefault(key, {})[found["stat"]] = value
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for (layer, role), got in sorted(by_tensor.items()):
        if "underflows%" not in got or "scale_inv_max" not in got:
            continue  # only the high-precision amax: a GEMM that ran no FP8 cast
        figures.setdefault(layer, {})[role] = {
            "amax": got.get("cur_amax", float("nan")),
            "scale": 1.0 / got["scale_inv_max"] if got["scale_inv_max"] else float("inf"),
            "underflow_pct": got["underflows%"],
            "saturation_pct": got.get("overflows%", 0.0),
        }
    return figures


class TeDebug:
    """--fp8_numerics on ``--model_impl te``: TE's debug tools, started before the first TE
    module is built (TE refuses a module built earlier), on every rank (their statistics are
    reduced over the ranks at each ``step_done``). Rank 0 keeps what they log for its reports.

    The figures are those of the report steps (every --logging_freq steps); a validation that
    follows a report step counts toward the next step's activation figures when that one
    reports too (TE's tools see every forward)."""

    def __init__(self, log_dir: str | Path, freq: int, delayed: bool, kept: tuple[int, ...]):
        import nvdlfw_inspect.api as debug_api
        import transformer_engine
        from nvdlfw_inspect.logging import BaseLogger

        class Collector(BaseLogger):
            def log_scalar(logger, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
                if self.keep:
                    self.stats[name] = torch.as_tensor(value, dtype=torch.float32)

        self.armed, self.keep = False, False
        self.stats: dict[str, torch.Tensor] = {}
        self.api = debug_api
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # JSON is YAML (the tools read it with yaml.safe_load). Every rank writes the same file:
        # each its own, then renamed in place, so no rank reads another's half-written one.
        config = log_dir / "config.yaml"
        write_whole(config, json.dumps(te_debug_config(freq, delayed, kept), indent=1) + "\n")
        features = Path(transformer_engine.__file__).parent / "debug" / "features"
        debug_api.initialize(
            config_file=str(config),
            feature_dirs=[str(features)],
            statistics_logger=Collector(),
            log_dir=str(log_dir),
        )

    @staticmethod
    def name_layers(model: nn.Module) -> None:
        """Each TE module by its place in the model (``model.layers.0.transformer_layer.
        self_attention.proj``; TE adds ``.fc1``/``.fc2`` for the fused MLP's GEMMs), before
        any wrapper: the names the config's layer pattern and the reports read."""
        for name, module in model.named_modules():
            if hasattr(module, "fp8_meta"):
                module.name = name

    def begin(self, start_step: int, keep: bool) -> None:
        """The tools count steps as the run does (the next step is ``start_step + 1``); ``keep``:
        this rank reports."""
        self.keep = keep
        self.api.initialize_training_step(start_step + 1)

    def step_done(self) -> None:
        """Every rank, every step: the tools reduce and log what the step measured."""
        self.api.step()

    def take(self) -> dict[str, dict[str, dict[str, float]]]:
        stats, self.stats = self.stats, {}
        if not stats:
            return {}
        device = next(iter(stats.values())).device
        values = torch.stack([value.to(device) for value in stats.values()]).cpu().tolist()
        return te_figures(dict(zip(stats, values, strict=True)))

    def close(self) -> None:
        self.api.end_debug()
