"""TEST DOUBLE of ``transformer_engine.common.recipe``: the recipe dataclasses and ``Format``.

Field names, order and defaults mirror TE 2.20.2 (tests/integration/test_te_contract.py compares
them), so code that builds a recipe here builds the same recipe on a GPU. Fields that only steer
CUDA kernels are accepted and ignored by the double's FP8 emulation; ``backward_override`` is
emulated (pytorch/__init__.py, ``_Fp8Gemm``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, NamedTuple

#: TE's ``_BACKWARD_OVERRIDES``: what a recipe's ``backward_override`` may be.
_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8/FP4 formats; ``HYBRID`` = E4M3 forward, E5M2 backward."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)


@dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    """Base class; ``scaling`` tells the double's emulation how to pick FP8 scales."""

    scaling: str = "tensor"

    def _check_format(self) -> None:
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
        assert self.backward_override in _BACKWARD_OVERRIDES, (
            "NVTE_BACKWARD_OVERRIDE must be unset or one of: 'high_precision', 'dequantized'."
        )

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)


@dataclass(repr=False)
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] | Callable = "max"
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    scaling = "delayed"

    def __post_init__(self) -> None:
        self._check_format()
        assert self.backward_override is None, (
            "Delayed scaling only supports backward_override=None."
        )

    def __repr__(self) -> str:
        return (
            f"recipe_type=DelayedScaling, margin={self.margin}, format={self.fp8_format.name}, "
            f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo}"
        )


@dataclass(repr=False)
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    scaling = "tensor"

    def __post_init__(self) -> None:
        self._check_format()

    def __repr__(self) -> str:
        return f"recipe_type=Float8CurrentScaling, format={self.fp8_format.name}"


@dataclass(repr=False)
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = os.getenv("NVTE_BACKWARD_OVERRIDE", None)
    enable_2d_quantization: bool = False

    scaling = "mxfp8"

    def __post_init__(self) -> None:
        self._check_format()

    def __repr__(self) -> str:
        return f"recipe_type=MXFP8BlockScaling, format={self.fp8_format.name}"


@dataclass(repr=False)
class Float8BlockScaling(Recipe):
    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    scaling = "block"

    def __post_init__(self) -> None:
        self._check_format()
        assert not self.fp8_dpa and not self.fp8_mha, (
            "FP8 attention is not supported for Float8BlockScaling."
        )

    def __repr__(self) -> str:
        return f"recipe_type=Float8BlockScaling, format={self.fp8_format.name}"


def recipe_kind(recipe: Any) -> str:
    """``delayed`` | ``tensor`` | ``block`` | ``mxfp8``: how the emulation scales tensors."""
    return getattr(recipe, "scaling", "tensor")
