"""The rule table of analysis/traces/rules.py, one test per rule (real kernel and operator
names, as torch.profiler and Kineto write them on CPU and on H100s), the precedence between
rules, and the GPU timeline's sweep (every instant counted once)."""

from __future__ import annotations

import pytest

from analysis.traces.device import sweep
from analysis.traces.host import category_of
from analysis.traces.rules import CATEGORIES, DEVICE, HOST, RULES, fp8_named, kinds_of

XMMA_FP8 = (
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas"
)
XMMA_BF16 = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas"
)
ELEMENTWISE = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
)
FLASH = (
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>, true, false, false>(Flash_fwd_params)"
)

#: (kind, side) -> (names the rule must catch, names it must not).
EXAMPLES: dict[tuple[str, str], tuple[list[str], list[str]]] = {
    ("collective", DEVICE): (
        [
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclWorkElem)",
        ],
        [ELEMENTWISE, XMMA_BF16],
    ),
    ("collective", HOST): (
        [
            "c10d::allreduce_",
            "record_param_comms",
            "gloo:all_gather",
            "nccl:_reduce_scatter_base",
            "_c10d_functional::all_gather_into_tensor",
        ],
        ["FSDP::all_gather_copy_in", "aten::copy_"],
    ),
    ("data_wait", HOST): (["data_wait"], ["aten::empty", "forward"]),
    ("forward", HOST): (["forward"], ["backward", "aten::_flash_attention_forward", "forward_x"]),
    ("optimizer", HOST): (
        ["optimizer", "Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"],
        ["lm_head", "aten::mul_"],
    ),
    ("outside_step", HOST): (["outside_step"], ["forward", "ProfilerStep#3"]),
    ("lm_head", HOST): (["lm_head"], ["model.lm_head.weight", "forward"]),
    ("attention", DEVICE): (
        [
            FLASH,
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel>",
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1",
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
        ],
        [XMMA_BF16, "void at::native::cunn_SoftMaxForward<4, float, float, float>"],
    ),
    ("attention", HOST): (
        [
            "aten::scaled_dot_product_attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_flash_attention_forward",
            "FusedAttnFunc",
        ],
        ["aten::softmax", "aten::bmm"],
    ),
    ("gemm", DEVICE): (
        [
            XMMA_FP8,
            XMMA_BF16,
            "nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT",
            "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8",
            "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        ],
        [ELEMENTWISE, "Memcpy HtoD (Pageable -> Device)"],
    ),
    ("gemm", HOST): (
        [
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::_scaled_mm",
            "aten::matmul",
            "aten::linear",
        ],
        ["aten::mul", "MmBackward0", "aten::mm_out_extra"],
    ),
    ("fp8_cast", DEVICE): (
        [
            "void transformer_engine::detail::cast_transpose_kernel<float, __nv_fp8_e4m3>",
            "void transformer_engine::delayed_scaling_recipe::kernel(AmaxParams)",
            "void transformer_engine::quantize_kernel<128>",
            "amax_final_reduce",
        ],
        [XMMA_BF16, ELEMENTWISE],
    ),
    ("fp8_cast", HOST): (
        [
            "_ToFloat8ConstrFunc",
            "matmul_with_hp_or_float8_args",
            "matmul_with_hp_or_float8_argsBackward",
        ],
        ["aten::mm", "aten::to"],
    ),
}


def rule_id(rule) -> str:
    return f"{rule.kind}-{rule.where}"


def test_every_rule_has_its_test_and_no_two_rules_share_a_row() -> None:
    rows = [(rule.kind, rule.where) for rule in RULES]
    assert len(rows) == len(set(rows))
    assert set(rows) == set(EXAMPLES)


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_rule(rule) -> None:
    caught, missed = EXAMPLES[(rule.kind, rule.where)]
    assert [n for n in caught if not rule.matches(n, rule.where)] == []
    assert [n for n in missed if rule.matches(n, rule.where)] == []
    other_side = HOST if rule.where == DEVICE else DEVICE
    assert not any(rule.matches(n, other_side) for n in caught)  # each side its own rules


def test_fp8_gemm_names() -> None:
    assert fp8_named(XMMA_FP8) and fp8_named("nvjet_qqtst_128x256_64x4_2x1_v_bz_coopB_TNT")
    # TE's hybrid format on an H100: e4m3 x e5m2 in the backward GEMMs (TE 2.20.2, cuBLAS 13)
    assert fp8_named("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT")
    assert fp8_named("aten::_scaled_mm")
    assert not fp8_named(XMMA_BF16) and not fp8_named("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT")


@pytest.mark.parametrize(
    ("kinds", "category"),
    [
        ({"gemm"}, "fp8_matmul"),
        ({"gemm", "lm_head"}, "bf16_matmul"),
        ({"gemm", "attention"}, "attention"),  # flash's cutlass templates, SDPA's bmm on CPU
        ({"gemm", "fp8_cast"}, "fp8_matmul"),  # the GEMM inside torchao's FP8 function
        ({"fp8_cast"}, "fp8_cast"),
        ({"collective", "optimizer"}, "comm_exposed"),  # the clip's all-reduce
        ({"lm_head"}, "loss"),
        ({"optimizer"}, "optimizer"),
        (set(), "other"),
    ],
)
def test_precedence_decides_the_category(kinds, category) -> None:
    assert category_of(frozenset(kinds)) == category
    assert category in CATEGORIES


def test_kinds_of_a_flash_kernel_are_attention_and_gemm_and_attention_wins() -> None:
    assert kinds_of(FLASH, DEVICE) == {"attention", "gemm"}
    assert category_of(kinds_of(FLASH, DEVICE)) == "attention"


def test_the_sweep_counts_every_instant_once() -> None:
    """Compute [0, 10) us, a collective [5, 20): 5 us overlapped, 10 exposed; nothing [20, 30)
    with data_wait on the host over [22, 25) and a checkpoint save over [26, 28)."""
    items = [(0.0, 10.0, "fp8_matmul"), (5.0, 20.0, "comm_exposed"), (2.0, 4.0, "other")]
    ms, overlapped = sweep(items, 0.0, 30.0, [(22.0, 25.0)], [(26.0, 28.0)])
    assert ms == pytest.approx(
        {"fp8_matmul": 0.010, "comm_exposed": 0.010, "data_wait": 0.003, "idle": 0.005}
    )
    assert overlapped == pytest.approx(5.0)
    assert sum(ms.values()) == pytest.approx(0.028)  # the window less the save
