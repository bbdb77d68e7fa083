"""``--profile_steps`` in real runs of train.py and ``analysis/step_breakdown.py`` on their traces.

One fp8/bf16 pair of the small Llama on 2 gloo ranks with 2 micro-batches per step (each rank
writes its own trace, the collectives and the accumulation are in them), and one 2-rank resume
from inside the window; every test reads these three runs. Real torch.profiler, real traces.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from helpers.runs import SMALL_LLAMA, records, run_train

from analysis import step_breakdown
from analysis.traces.breakdown import read_rank
from analysis.traces.rules import CATEGORIES

#: The window: steps 3 and 4 of 4 (step 2 warms the profiler up).
FLAGS = [
    *SMALL_LLAMA,
    "--train_batch_size=2",
    "--grad_accum_steps=2",
    "--max_steps=4",
    "--warmup=1",
    "--profile_steps=3:4",
    "--checkpoint_freq=3",
    "--keep_last=0",
    "--validation_batches=1",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("profiled")
    runs = {}
    for precision in ("bf16", "fp8"):
        out = root / precision
        fp8 = "--fp8=1" if precision == "fp8" else "--fp8=0"
        run_train(*FLAGS, fp8, f"--output_dir={out}", nproc=2)
        runs[precision] = out
    resumed = root / "resumed"
    checkpoint = runs["bf16"] / "checkpoints" / "step_00000003"
    result = run_train(
        *FLAGS,
        "--fp8=0",
        f"--output_dir={resumed}",
        f"--resume_from_checkpoint={checkpoint}",
        nproc=2,
    )
    runs["resumed"], runs["resumed_log"] = resumed, result.stdout
    return runs


def traces(run: Path) -> list[Path]:
    return sorted(run.glob("profile/*/*"))


def test_every_rank_writes_one_whole_trace_of_the_window(pair) -> None:
    for precision in ("bf16", "fp8"):
        found = traces(pair[precision])
        names = [p.relative_to(pair[precision]).as_posix() for p in found]
        assert names == [f"profile/step_3/rank_{r}.pt.trace.json.gz" for r in (0, 1)], names
        for path in found:
            trace = json.loads(gzip.decompress(path.read_bytes()))
            meta = trace["llama_recipe_profile"]
            assert (meta["first_step"], meta["active_first"], meta["end"]) == (2, 3, 4)
            assert trace["distributedInfo"]["world_size"] == 2


def test_the_categories_add_up_to_the_steps_the_run_timed(pair) -> None:
    """Per rank: the profiled steps are steps metrics.jsonl timed (the same numbers, both
    ranks), and the categories sum exactly to each profiled step. How close the two clocks
    agree is a measurement, not a pass/fail on a shared CPU: benchmarks/bench_profiler_cost.py."""
    for precision in ("bf16", "fp8"):
        run = pair[precision]
        timed = {r["step"]: r["step_seconds"] for r in records(run)}
        for rank in (0, 1):
            got = read_rank(run / "profile" / "step_3" / f"rank_{rank}.pt.trace.json.gz", rank)
            # both steps, one of them possibly left out as an outlier (over 1.5x the median:
            # 3x the other, which this shared CPU's load can make a step)
            assert got.steps and sorted([s.step for s in got.steps] + got.left_out) == [3, 4]
            for step in got.steps:
                assert timed[step.step] > 0 and step.total_ms > 0
                assert sum(step.ms.values()) == pytest.approx(step.total_ms, rel=1e-9)
            assert set(got.ms) == set(CATEGORIES)
            # the parts the annotations and rules find (how much of a step they explain is
            # test_trace_device's, on recorded H100 traces: here it depends on the machine's load)
            assert got.ms["fp8_matmul"] > 0 and got.ms["bf16_matmul"] > 0
            assert got.ms["optimizer"] > 0 and got.ms["comm_exposed"] > 0
            # the forward's compute (the projection's per-layer split): some of the step's
            assert 0 < got.forward_ms < got.total_ms - got.ms["optimizer"]


def test_lm_head_stays_bf16_and_only_the_fp8_run_casts(pair) -> None:
    bf16 = read_rank(pair["bf16"] / "profile/step_3/rank_0.pt.trace.json.gz", 0)
    fp8 = read_rank(pair["fp8"] / "profile/step_3/rank_0.pt.trace.json.gz", 0)
    assert bf16.ms["fp8_cast"] == 0 and bf16.fp8_gemm_ms == 0
    assert fp8.ms["fp8_cast"] > 0 and fp8.fp8_gemm_ms == pytest.approx(fp8.ms["fp8_matmul"])
    lm_head = [name for name in fp8.gemm_names if name.startswith("bf16_matmul\t")]
    assert lm_head, fp8.gemm_names  # torchao leaves lm_head a bf16 linear


def test_step_breakdown_prints_both_runs_and_the_ceiling(pair, capsys) -> None:
    assert step_breakdown.main([str(pair["bf16"]), str(pair["fp8"])]) == 0
    out = capsys.readouterr().out
    for precision in ("bf16", "fp8"):  # step 4 may be left out as an outlier (a loaded CPU)
        assert re.search(rf"{pair[precision]} \({precision}\): step_3, steps 3(, 4)?, 2 rank", out)
    assert "slowest: rank" in out
    assert f"fp8 {pair['fp8']} against bf16 {pair['bf16']} (slowest rank of each):" in out
    # a ceiling, or (what FP8 does not touch moved: this CPU's load) no ceiling and why; both
    # verdicts on fixed numbers: test_trace_device
    assert ("; ceiling " in out) != ("Not comparable: what FP8 does not touch moved" in out)
    assert "CPU traces: FP8 here is torchao's emulation" in out
    assert "HTA" not in out  # CPU traces: no cross-check is attempted


def test_a_resume_inside_the_window_traces_the_steps_still_to_come(pair) -> None:
    run = pair["resumed"]
    names = [p.relative_to(run).as_posix() for p in traces(run)]
    assert names == [f"profile/step_4/rank_{r}.pt.trace.json.gz" for r in (0, 1)], names
    assert "Profiler trace of step(s) 4: " in pair["resumed_log"]
    got = read_rank(run / "profile/step_4/rank_1.pt.trace.json.gz", 1)
    assert [s.step for s in got.steps] == [4]


def test_step_breakdown_refuses_a_run_without_traces_in_one_line(pair, capsys) -> None:
    from helpers.procs import script_refusal

    err = script_refusal(
        step_breakdown.main, "step_breakdown.py", [str(pair["bf16"] / "checkpoints")], capsys
    )
    assert "no profiler traces" in err and "--profile_steps START:END" in err
    assert f"({pair['bf16'] / 'checkpoints' / 'profile'} has no window)" in err


def test_step_breakdown_refuses_a_broken_trace_or_window_in_one_line(
    pair, tmp_path, capsys
) -> None:
    """A trace that is JSON of another shape, and a window that is a file, ended in an
    AttributeError and a NotADirectoryError; a run record whose flags are no object is read
    as no flags."""
    import gzip
    import shutil

    from helpers.procs import script_refusal

    run = tmp_path / "run"
    shutil.copytree(pair["bf16"], run, ignore=shutil.ignore_patterns("checkpoints"))
    [window] = (run / "profile").iterdir()
    for trace in window.glob("rank_*.pt.trace.json.gz"):
        trace.write_bytes(gzip.compress(b"[1, 2]"))
    err = script_refusal(step_breakdown.main, "step_breakdown.py", [str(run)], capsys)
    # Chrome's other trace form, a bare list: named, not AttributeError("'list' object ...")
    assert (
        "cannot be read as a profiler trace: ValueError(\"a JSON list, not torch.profiler's " in err
    )
    step = window.name.removeprefix("step_")
    err = script_refusal(
        step_breakdown.main, "step_breakdown.py", [str(run), "--window", "99"], capsys
    )
    assert f"{run / 'profile'} has no step_99: give --window {step}" in err
    shutil.rmtree(window)
    window.write_text("")
    err = script_refusal(step_breakdown.main, "step_breakdown.py", [str(run)], capsys)
    assert f"{window} is no trace folder (a file in its place)" in err
    (run / "metrics.jsonl").write_text('{"kind": "run", "flags": "x"}\n')
    assert step_breakdown.run_flags(run) == {}
