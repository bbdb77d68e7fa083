"""The GPU half of the breakdown on two real H100 traces (tests/traces/, made by
tests/traces/make_h100_traces.py): cuBLAS's nvjet GEMMs split by the range that launched them
(``lm_head``'s forward and, through the profiler's forward/backward link, its two backward GEMMs
in the bf16 share), cuBLAS's FP8 GEMM found by name only in the fp8 trace, cuDNN's attention,
and the categories adding up to the device's step; then scripts/step_breakdown.py on the pair."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model_utils.run.breakdown import read_rank
from scripts import step_breakdown

TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.fixture(scope="module")
def h100():
    return {p: read_rank(TRACES / f"h100_{p}.pt.trace.json.gz", 0) for p in ("bf16", "fp8")}


def gemms(rank, category: str) -> dict[str, float]:
    prefix = f"{category}\t"
    return {k[len(prefix) :]: v for k, v in rank.gemm_names.items() if k.startswith(prefix)}


def test_fp8_gemm_kernels_only_under_fp8_and_in_the_share_fp8_can_run(h100) -> None:
    assert h100["bf16"].fp8_gemm_ms == 0
    fp8_kernels = [k for k in gemms(h100["fp8"], "fp8_matmul") if "qq" in k]
    assert fp8_kernels and all(k.startswith("nvjet_sm90_qqtst_") for k in fp8_kernels)
    assert h100["fp8"].fp8_gemm_ms == pytest.approx(
        gemms(h100["fp8"], "fp8_matmul")[fp8_kernels[0]]
    )


def test_lm_heads_three_gemms_are_in_the_bf16_share(h100) -> None:
    """Forward (TNT) and both gradients (NNT, NTT) of the 4096 -> 32000 head: 7.8x the FLOPs of
    the 4096-wide linear's forward and weight gradient (its input needs no gradient)."""
    for rank in h100.values():
        head, layer = gemms(rank, "bf16_matmul"), gemms(rank, "fp8_matmul")
        assert sorted(k[-3:] for k in head) == ["NNT", "NTT", "TNT"]
        assert sorted(k[-3:] for k in layer if "qq" not in k) == ["NTT", "TNT"]
        assert rank.ms["bf16_matmul"] > 5 * (rank.ms["fp8_matmul"] - rank.fp8_gemm_ms)
        assert not any("qq" in k for k in head)


def test_the_device_step_adds_up(h100) -> None:
    for rank in h100.values():
        assert [s.step for s in rank.steps] == [1, 2]
        for step in rank.steps:
            assert sum(step.ms.values()) == pytest.approx(step.total_ms, rel=1e-9)
        assert rank.ms["attention"] > 0 and rank.ms["optimizer"] > 0 and rank.ms["loss"] > 0
        assert rank.ms["idle"] < 0.05 * rank.total_ms  # the host kept the GPU fed
        assert rank.gpu


def test_step_breakdown_on_the_h100_pair(tmp_path, capsys) -> None:
    runs = []
    for precision in ("bf16", "fp8"):
        run = tmp_path / precision
        (run / "profile" / "step_1").mkdir(parents=True)
        shutil.copy(
            TRACES / f"h100_{precision}.pt.trace.json.gz",
            run / "profile" / "step_1" / "rank_0.pt.trace.json.gz",
        )
        record = {"kind": "run", "flags": {"fp8": precision == "fp8"}}
        (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        runs.append(str(run))
    assert step_breakdown.main(runs) == 0
    out = capsys.readouterr().out
    assert "The matmuls FP8 can run were " in out and "; ceiling " in out
    assert "the ceiling would be" in out
    assert out.count("HTA") >= 2  # per GPU run: its cross-check, or one line saying why none


def test_hta_reads_the_same_h100_traces(h100) -> None:
    """Where Holistic Trace Analysis is installed (the optional [hta] extra): its temporal
    breakdown of the fp8 trace's first step (it drops the last) has the breakdown's step as
    kernel time, within 2%."""
    pytest.importorskip("hta")
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_files={0: str(TRACES / "h100_fp8.pt.trace.json.gz")})
    temporal = analysis.get_temporal_breakdown(visualize=False)
    kernel_ms = float(temporal["kernel_time(us)"].iloc[0]) / 1000
    assert kernel_ms == pytest.approx(h100["fp8"].steps[0].total_ms, rel=0.02)
