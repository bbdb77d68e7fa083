"""A test-only build with FP8 deliberately damaged (on PYTHONPATH, Python imports this at start):
torchao's dynamic scales come out 2^-16 of what they should be, so most of every FP8 cast
underflows to zero. What the parity verdict must call "drifts" and --fp8_numerics must show as
underflow (tests/integration/test_parity_run.py). Only train.py processes are damaged."""

import sys

if sys.argv and sys.argv[0].endswith("train.py"):
    import torchao.float8.float8_utils as float8_utils

    _healthy = float8_utils.amax_to_scale

    def _damaged(amax, float8_dtype, round_scales_to_power_of_2=False):
        return _healthy(amax, float8_dtype, round_scales_to_power_of_2) * 2.0**-16

    float8_utils.amax_to_scale = _damaged
