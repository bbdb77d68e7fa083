"""The one table that names what a profiler event is: GEMM, attention, collective, FP8 cast, or
one of the recipe's own ranges (``model_utils/model/annotate.py``).

Data, not code paths: ``analysis/traces/breakdown.py`` applies every rule to every event's name
and resolves what matched with :data:`PRECEDENCE`; ``tests/unit/test_trace_rules.py`` holds one
test per rule (names it must catch, names it must not). A new kernel family is a new row.

A kernel name does not always say what FP8 can run: cuBLAS's ``nvjet`` kernels (H100) encode
their types in letters, and the same GEMM kernel serves a decoder layer and ``lm_head``. So
*whether* a GEMM is one FP8 can run is decided by where it was launched (inside the ``lm_head``
range or not, following a backward op to its forward through the profiler's forward/backward
links), and the name only adds whether it ran in FP8 (:data:`FP8_GEMM_NAME`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Where a rule looks: "host" (CPU operators and ``record_function`` ranges), "device" (GPU
#: kernels, copies and sets), or both.
HOST, DEVICE, ANY = "host", "device", "any"


@dataclass(frozen=True)
class Rule:
    kind: str  # gemm, attention, collective, fp8_cast, data_wait, optimizer, lm_head, ...
    where: str  # HOST, DEVICE or ANY
    pattern: str  # a regular expression searched (not matched) in the name, ignoring case
    catches: str  # what it is for: the docs' words and the test's subject

    def matches(self, name: str, side: str) -> bool:
        return self.where in (ANY, side) and re.search(self.pattern, name, re.I) is not None


RULES: tuple[Rule, ...] = (
    # -- collectives --------------------------------------------------------------------------
    Rule(
        "collective",
        DEVICE,
        r"^nccl|nccl(dev)?kernel",
        "NCCL kernels (ncclDevKernel_*, ncclKernel_*)",
    ),
    Rule(
        "collective",
        HOST,
        r"^(c10d::|c10d_functional::|_c10d_functional::|gloo:|nccl:)|"
        r"^record_param_comms$",
        "torch.distributed's operators (gloo on CPU, NCCL's host "
        "side): c10d::allreduce_, record_param_comms, gloo:all_gather",
    ),
    # -- the recipe's ranges ------------------------------------------------------------------
    Rule("data_wait", HOST, r"^data_wait$", "the wait for the next micro-batch (run/step.py)"),
    Rule("forward", HOST, r"^forward$", "the model's forward: its compute per layer (projection)"),
    Rule(
        "optimizer",
        HOST,
        r"^optimizer$|^Optimizer\.(step|zero_grad)#",
        "clip, AdamW, the LR schedule (run/step.py's range and torch's Optimizer.step# ranges)",
    ),
    Rule(
        "outside_step",
        HOST,
        r"^outside_step$",
        "validation and checkpoint saves: no part of the step (the run's meter leaves them out)",
    ),
    Rule(
        "lm_head",
        HOST,
        r"^lm_head$",
        "lm_head and the loss through it (model/loss.py): bf16 in every FP8 recipe",
    ),
    # -- attention ----------------------------------------------------------------------------
    Rule(
        "attention",
        DEVICE,
        r"flash|fmha|fused_attn|cudnn.*(attn|sdpa|mha)|sdpa|"
        r"attention",
        "attention kernels: flash (flash_fwd/bwd), cuDNN's fused "
        "attention (cudnn_generated_fort_native_sdpa, fmha), TE's fused_attn",
    ),
    Rule(
        "attention",
        HOST,
        r"scaled_dot_product|flash_attention|efficient_attention|"
        r"fused_attn|FusedAttnFunc|DotProductAttention|^aten::_flash",
        "attention operators: "
        "SDPA and its CPU/flash/efficient kernels, TE's fused attention function",
    ),
    # -- GEMMs --------------------------------------------------------------------------------
    Rule(
        "gemm",
        DEVICE,
        r"gemm|nvjet|xmma|cutlass|cublas|wgmma",
        "GEMM kernels: cuBLAS "
        "(sm90_xmma_gemm_*, nvjet_* on H100, *_cublas), CUTLASS (cutlass3x_*), TE's GEMMs",
    ),
    Rule(
        "gemm",
        HOST,
        r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|"
        r"_scaled_grouped_mm)$",
        "aten's matrix products on CPU (and _scaled_mm, the FP8 one)",
    ),
    # -- what FP8 adds ------------------------------------------------------------------------
    Rule(
        "fp8_cast",
        DEVICE,
        r"cast_transpose|quantize|amax|compute_scale|fp8_cast|"
        r"cast_fp8|delayed_scaling|scale_and_cast|float8",
        "FP8 casts and scaling: TE's "
        "cast_transpose, (de)quantize, amax and scale updates; torchao's float8 casts",
    ),
    Rule(
        "fp8_cast",
        HOST,
        r"float8|ToFloat8|matmul_with_hp_or_float8_args|fp8",
        "torchao's float8 casts and its FP8 matmul function (the GEMMs inside stay GEMMs)",
    ),
)

#: Of all the kinds an event and its ancestors matched, the first of this order decides its
#: category: a GEMM inside attention is attention; a collective inside the optimizer's range is
#: a collective; a GEMM inside torchao's FP8 function is a GEMM, the rest of it a cast.
PRECEDENCE = ("collective", "data_wait", "attention", "gemm", "fp8_cast", "optimizer", "lm_head")

#: A GEMM whose kernel name says FP8 (cuBLAS xmma ``e4m3``/``e5m2``, nvjet's operand type
#: letters ``q`` (e4m3) and ``r`` (e5m2): ``qq`` forward, ``qr``/``rq`` the backward GEMMs of
#: TE's hybrid format; ``_scaled_mm``). Names only add evidence: CUTLASS names may say nothing.
FP8_GEMM_NAME = r"e4m3|e5m2|fp8|float8|nvjet_(sm\d+_)?(q[qr]|rq)|_scaled_mm"


#: Category key -> the words a report uses, in the report's order.
CATEGORIES: dict[str, str] = {
    "fp8_matmul": "matmuls FP8 can run",
    "bf16_matmul": "matmuls FP8 cannot run (lm_head)",
    "fp8_cast": "FP8 casts and scaling",
    "attention": "attention",
    "loss": "lm_head's loss, not matmul",
    "comm_exposed": "collectives, exposed",
    "optimizer": "optimizer",
    "data_wait": "data wait",
    "other": "other",
    "idle": "GPU idle, waiting for the host",
}


def kinds_of(name: str, side: str) -> frozenset[str]:
    """Every kind whose rule catches ``name`` on ``side`` (HOST or DEVICE)."""
    return frozenset(rule.kind for rule in RULES if rule.matches(name, side))


def fp8_named(name: str) -> bool:
    return re.search(FP8_GEMM_NAME, name, re.I) is not None
