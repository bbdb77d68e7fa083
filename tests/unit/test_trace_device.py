"""The GPU half of the breakdown on two real H100 traces (tests/traces/, made by
tests/traces/make_h100_traces.py): cuBLAS's nvjet GEMMs split by the range that launched them
(``lm_head``'s forward and, through the profiler's forward/backward link, its two backward GEMMs
in the bf16 share), cuBLAS's FP8 GEMM found by name only in the fp8 trace, cuDNN's attention,
and the categories adding up to the device's step; then analysis/step_breakdown.py on the pair."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from analysis import step_breakdown
from analysis.traces.breakdown import read_rank

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


# --------------------------------------------------------------------------------------------
# Transformer Engine at full depth: the te-bf16/te-fp8 pair of benchmarks/gpu_levers.sh `full`
# (Llama 3.2 1B, 16 TE layers, tied embeddings, seq 8192, micro-batch 4, --compile, steps 19-20;
# H100, TE 2.20.2, 2026-11-26; benchmarks/results/2026-11-26-h100-full-depth.md).


@pytest.fixture(scope="module")
def te_1b():
    return {
        p: read_rank(TRACES / f"te_llama32_1b_{p}.pt.trace.json.gz", 0) for p in ("bf16", "fp8")
    }


def test_te_fp8_gemms_are_all_fp8_by_name_and_none_under_bf16(te_1b) -> None:
    """Every GEMM of the share FP8 can run is an FP8 kernel under --fp8=1 (nvjet's qq forward,
    qr for the e5m2 gradients of the hybrid format) and none is under --fp8=0."""
    from analysis.traces.rules import fp8_named

    fp8 = gemms(te_1b["fp8"], "fp8_matmul")
    assert {k.split("_1")[0][:16] for k in fp8} == {"nvjet_sm90_qqtst", "nvjet_sm90_qrtst"}
    assert all(fp8_named(k) for k in fp8)
    assert te_1b["fp8"].fp8_gemm_ms == pytest.approx(te_1b["fp8"].ms["fp8_matmul"], rel=1e-6)
    assert te_1b["bf16"].fp8_gemm_ms == 0
    kernels = [k.split("\t", 1)[1] for k in te_1b["bf16"].gemm_names]  # "category\tkernel"
    assert kernels and not any(fp8_named(k) for k in kernels)
    assert te_1b["fp8"].ms["fp8_cast"] > 0 and te_1b["bf16"].ms["fp8_cast"] == 0


def test_te_lm_head_gemms_stay_bf16_and_cost_the_same_in_both(te_1b) -> None:
    """The tied 2048 x 128256 head: its three GEMMs are bf16 kernels in the other share, and
    FP8 does not change them (within 2%)."""
    from analysis.traces.rules import fp8_named

    for rank in te_1b.values():
        head = gemms(rank, "bf16_matmul")
        assert len(head) == 3 and not any(fp8_named(k) for k in head)
        for step in rank.steps:
            assert sum(step.ms.values()) == pytest.approx(step.total_ms, rel=1e-9)
    bf16, fp8 = (te_1b[p].ms["bf16_matmul"] for p in ("bf16", "fp8"))
    assert fp8 == pytest.approx(bf16, rel=0.02)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_rules_attribute_all_but_a_small_share_of_a_whole_models_step(precision) -> None:
    """The Llama 3.2 1B traces (one H100, te_llama): what no rule or annotation claims ("other")
    is a small share of the step, so the breakdown explains the step. (On a CPU run the share
    depends on what else the machine runs: test_profile_processes checks its structure.)"""
    got = read_rank(TRACES / f"te_llama32_1b_{precision}.pt.trace.json.gz", 0)
    assert got.ms["other"] < 0.2 * got.total_ms, got.ms
    assert sum(got.ms.values()) == pytest.approx(got.total_ms, rel=1e-9)


def _profiled(run: Path, precision: str, trace: str, **flags) -> str:
    (run / "profile" / "step_1").mkdir(parents=True)
    shutil.copy(TRACES / trace, run / "profile" / "step_1" / "rank_0.pt.trace.json.gz")
    record = {"kind": "run", "flags": {"fp8": precision == "fp8", "hidden_width": 2048, **flags}}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return str(run)


def test_step_breakdown_refuses_a_pair_of_different_models_in_one_line(tmp_path, capsys) -> None:
    from helpers.procs import script_refusal

    bf16 = _profiled(tmp_path / "a", "bf16", "te_llama32_1b_bf16.pt.trace.json.gz")
    fp8 = _profiled(tmp_path / "b", "fp8", "te_llama32_1b_fp8.pt.trace.json.gz", hidden_width=128)
    err = script_refusal(step_breakdown.main, "step_breakdown.py", [bf16, fp8, "--no_hta"], capsys)
    assert f"{fp8} is not like {bf16}: hidden_width 128 vs 2048" in err
    assert "only --fp8 differs" in err
    # --fp8_numerics' report steps tripled the FP8 step: called "another job" before
    numerics = _profiled(
        tmp_path / "c", "fp8", "te_llama32_1b_fp8.pt.trace.json.gz", fp8_numerics=True
    )
    err = script_refusal(step_breakdown.main, "step_breakdown.py", [bf16, numerics], capsys)
    assert f"{numerics} is not like {bf16}: fp8_numerics True vs None" in err


def test_step_breakdown_refuses_a_damaged_or_cut_short_trace_in_one_line(tmp_path, capsys) -> None:
    """Bytes flipped inside the .gz (zlib's error, which is no OSError) were a traceback; a
    file cut short (the profiler still writing it) too is one line naming the file and the fix."""
    from helpers.procs import script_refusal

    run = _profiled(tmp_path / "a", "bf16", "te_llama32_1b_bf16.pt.trace.json.gz")
    trace = tmp_path / "a" / "profile" / "step_1" / "rank_0.pt.trace.json.gz"
    whole = gzip.compress(b'{"traceEvents": []}', mtime=0)
    damaged = whole[:10] + b"\x07" + whole[11:]  # the first deflate block of the reserved type
    for data, why in (
        (damaged, "error('Error -3 while decompressing data: invalid block type')"),
        (
            whole[:-9],
            "EOFError('Compressed file ended before the end-of-stream marker was reached')",
        ),
    ):
        trace.write_bytes(data)
        err = script_refusal(step_breakdown.main, "step_breakdown.py", [run, "--no_hta"], capsys)
        assert err == (
            f"step_breakdown.py: error: {trace} cannot be read as a profiler trace: {why}; "
            "profile it again or delete it\n"
        )


def test_a_pair_whose_untouched_categories_moved_gets_no_ceiling(tmp_path) -> None:
    """The recorded 1B pair: within 5% where FP8 does not act, so a ceiling; the same pair with
    the fp8 run's "other" (host-side Python) twice as slow, what another job on the machine
    does, is named as measured under different conditions, and no ceiling is printed."""
    import dataclasses

    runs = [
        step_breakdown.read_run(
            Path(_profiled(tmp_path / p, p, f"te_llama32_1b_{p}.pt.trace.json.gz")), None
        )
        for p in ("bf16", "fp8")
    ]
    assert runs[1].label == "fp8" and runs[0].label == "bf16"
    assert step_breakdown.moved_untouched(*runs) == []
    assert "; ceiling " in step_breakdown.format_pair(*runs)
    slow = runs[1].ranks[0]
    slowed = {**slow.ms, "other": 2 * slow.ms["other"]}
    runs[1].ranks[0] = dataclasses.replace(slow, ms=slowed)
    assert step_breakdown.moved_untouched(*runs) == ["other 0.48x"]
    text = step_breakdown.format_pair(*runs)
    assert "Not comparable: what FP8 does not touch moved (other 0.48x)" in text
    assert "; ceiling " not in text and step_breakdown.ceiling(*runs) is None
    assert "CPU traces" not in text  # GPU traces: real FP8


def test_a_runs_own_precision_names_it(tmp_path) -> None:
    run = _profiled(tmp_path / "a", "bf16", "te_llama32_1b_bf16.pt.trace.json.gz", bf16=False)
    assert step_breakdown.read_run(Path(run), None).label == "fp32"


def test_what_ifs_follow_the_measured_shares(tmp_path) -> None:
    """The recorded 1B pair's what-ifs, by hand from its categories: lm_head's GEMMs and then
    attention moved to the FP8 matmuls' measured speed-up, and the fp8 step without its idle."""
    runs = [
        step_breakdown.read_run(
            Path(_profiled(tmp_path / p, p, f"te_llama32_1b_{p}.pt.trace.json.gz")), None
        )
        for p in ("bf16", "fp8")
    ]
    a, b = runs[0].slowest.ms, runs[1].slowest
    found = step_breakdown.ceiling(*runs)
    got = dict(step_breakdown.what_ifs(*runs, found))
    total, y = runs[0].slowest.total_ms, a["fp8_matmul"] / b.ms["fp8_matmul"]

    def by_hand(*keys: str) -> float:
        moved = a["fp8_matmul"] + sum(a[k] for k in keys)
        return total / (total - moved + moved / y)

    values = list(got.values())
    assert values[0] == pytest.approx(found.ceiling) == pytest.approx(by_hand())
    assert values[1:4] == pytest.approx(
        [by_hand("bf16_matmul"), by_hand("attention"), by_hand("bf16_matmul", "attention")]
    )
    assert values[4] == pytest.approx(total / (b.total_ms - b.ms["idle"]))
    assert values[0] < values[1] < values[3] and values[2] < values[3]
    text = step_breakdown.format_pair(*runs)
    assert "+ attention in FP8 (at 1.85x: a bound)" in text and "What if" in text
