"""--profile_steps and --memory_snapshot_step: the flags' refusals, the window a launch traces,
and model_utils/run/profiling.RunProfiler driving the real torch.profiler over a small training
loop in this process: a whole trace per window, written atomically (a failed step's window
dropped, a full disk one warning), the step's ranges in it, and the one-line OOM."""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from analysis.traces.breakdown import rank_steps
from analysis.traces.host import Host
from model_utils.checkpoint.resume import config_changes
from model_utils.model import loss as model_loss
from model_utils.model.annotate import BACKWARD, DATA_WAIT, FORWARD, OPTIMIZER, annotate
from model_utils.run import profiling
from model_utils.run.profiling import RunProfiler, StepOutOfMemory, Window, plan_window


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--profile_steps", "3"], "--profile_steps takes START:END"),
        (["--profile_steps", "a:b"], "--profile_steps takes START:END"),
        (["--profile_steps", "0:2"], "steps count from 1"),
        (["--profile_steps", "1:1"], "the one before START warms the profiler up (START >= 2)"),
        (["--profile_steps", "4:3"], "END must not come before START"),
        (["--profile_steps", "5:12", "--max_steps", "10"], "ends after --max_steps 10"),
        (["--memory_snapshot_step", "-1"], "--memory_snapshot_step must be in [0,"),
        (["--memory_snapshot_step", "2"], "it needs a CUDA GPU"),
    ],
)
def test_bad_values_are_refused_in_one_line(refused_by_train, flags, words) -> None:
    _, lines, _ = refused_by_train("--preset", "tiny", *flags)
    assert len(lines) == 1 and words in lines[0], lines


@pytest.mark.parametrize(
    ("spec", "done", "window"),
    [
        (None, 0, None),
        ("20:23", 0, Window(19, 20, 23)),  # one warm-up step before the window
        ("20:23", 19, Window(20, 20, 23)),  # resumed just before: no warm-up step left
        ("20:23", 21, Window(22, 22, 23)),  # resumed inside: the steps still to come
        ("20:23", 23, None),  # resumed after: the window is not traced again
        ("20:23", 40, None),
    ],
)
def test_the_window_a_launch_traces(spec, done, window) -> None:
    assert plan_window(spec, done) == window


def test_a_launch_past_the_window_says_nothing_is_profiled(tmp_path, caplog) -> None:
    """A resume at step 40 of a run with --profile_steps 20:23 traced nothing, silently."""
    run = SimpleNamespace(
        output_dir=str(tmp_path), profile_steps="20:23", memory_snapshot_step=None
    )
    with caplog.at_level("WARNING", logger="train"):
        RunProfiler(run, 0, 1, torch.device("cpu"), 40)
        RunProfiler(run, 0, 1, torch.device("cpu"), 22)  # inside: the rest is traced
    assert [r.getMessage() for r in caplog.records] == [
        "--profile_steps 20:23 ended before step 41: no trace"
    ]


def test_a_resume_may_change_the_observation_flags() -> None:
    saved = {"profile_steps": None, "memory_snapshot_step": None, "tensorboard": False}
    now = {"profile_steps": "5:6", "memory_snapshot_step": 0, "tensorboard": True}
    refused, allowed = config_changes(saved, now)
    assert refused == [] and len(allowed) == 3


class Tiny(nn.Module):
    """A decoder-ish linear and an annotated lm_head (as --chunked_loss=0 builds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        model_loss.annotate_lm_head(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.layer(x))).square().mean()


def train(out: Path, spec: str, steps: int, fail_at: int | None = None) -> RunProfiler:
    """``steps`` steps of Tiny under RunProfiler, as train.py's loop drives it."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = SimpleNamespace(output_dir=str(out), profile_steps=spec, memory_snapshot_step=None)
    profiler = RunProfiler(run, 0, 1, torch.device("cpu"), 0)
    with profiler:
        for step in range(1, steps + 1):
            with annotate(DATA_WAIT):
                x = torch.randn(16, 32)
            with annotate(FORWARD):
                value = model(x)
            if step == fail_at:
                raise RuntimeError("a step failed")
            with annotate(BACKWARD):
                value.backward()
            with annotate(OPTIMIZER):
                opt.step()
                opt.zero_grad()
            profiler.step(step)
    return profiler


def written(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def test_the_window_is_one_whole_trace_with_the_steps_and_their_ranges(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="train"):
        train(tmp_path, "3:4", steps=6)
    assert written(tmp_path) == ["profile/step_3/rank_0.pt.trace.json.gz"]
    path = tmp_path / "profile/step_3/rank_0.pt.trace.json.gz"
    trace = json.loads(gzip.decompress(path.read_bytes()))
    assert trace["llama_recipe_profile"] == {
        "first_step": 2,
        "active_first": 3,
        "end": 4,
        "rank": 0,
        "world_size": 1,
    }
    assert [s.step + 2 for s in rank_steps(trace)] == [3, 4]  # ProfilerStep#1, #2
    names = {e["name"] for e in trace["traceEvents"]}
    assert {DATA_WAIT, FORWARD, BACKWARD, OPTIMIZER, "lm_head"} <= names
    assert [r.message for r in caplog.records if "Profiler trace" in r.message] == [
        f"Profiler trace of step(s) 3-4: {path} (one per rank: rank_*.pt.trace.json.gz); read it "
        f"with `{sys.executable} -m analysis.step_breakdown {tmp_path}`"
    ]


def test_kineto_progress_lines_are_dropped_and_the_rest_of_stderr_kept(tmp_path, capfd) -> None:
    """A profiled window leaves no `USDT: ... profiler_start` line on stderr (fd 2, where
    Kineto's C++ writes); whatever else is written there meanwhile passes, in order."""
    train(tmp_path, "2:3", steps=4)
    assert "USDT:" not in capfd.readouterr().err
    with profiling.kineto_lines_dropped():
        os.write(2, b"USDT:2026 x.cpp:1] profiler_start\nan error line\n")
        print("a Python line", file=sys.stderr)
        os.write(2, b"STAGE:2026 x.cpp:2] Completed Stage\n")
    # (in order on a real fd 2; here pytest's sys.stderr writes beside it)
    assert sorted(capfd.readouterr().err.splitlines()) == ["a Python line", "an error line"]


def test_lm_heads_backward_gemm_follows_its_forward_into_the_bf16_share(tmp_path) -> None:
    """With --chunked_loss=0 the lm_head range covers only the forward GEMM; the profiler's
    forward/backward link carries it to the weight and input gradients' GEMMs."""
    train(tmp_path, "2:2", steps=2)
    trace = json.loads(gzip.decompress(next(tmp_path.rglob("*.gz")).read_bytes()))
    host = Host(trace["traceEvents"])
    in_backward = []
    for evs in host.by_tid.values():
        for ev in evs:
            above, up = [], ev.parent
            while up is not None:
                above.append(up.name)
                up = up.parent
            if "gemm" in ev.kinds and BACKWARD in above:
                in_backward.append("lm_head" in ev.chain)
    assert True in in_backward and False in in_backward  # lm_head's and the layer's
    (step,) = rank_steps(trace)
    assert step.ms["bf16_matmul"] > 0 and step.ms["fp8_matmul"] > 0


def test_a_failed_step_inside_the_window_leaves_no_trace(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="a step failed"):
        train(tmp_path, "2:4", steps=6, fail_at=3)
    assert written(tmp_path) == []


def test_a_stop_inside_the_window_writes_the_steps_recorded(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="train"):
        train(tmp_path, "2:4", steps=3)  # a preemption's clean stop after step 3
    path = tmp_path / "profile/step_2/rank_0.pt.trace.json.gz"
    assert written(tmp_path) == [path.relative_to(tmp_path).as_posix()]
    trace = json.loads(gzip.decompress(path.read_bytes()))
    assert len(rank_steps(trace)) == 2
    assert any("step(s) 2-3 (the run stopped inside 2-4)" in r.message for r in caplog.records)


def test_a_full_disk_costs_the_trace_and_one_warning_not_the_run(small_disk, caplog) -> None:
    disk = small_disk("full", 0.008)  # 8 KiB: less than a compressed trace of Tiny
    with caplog.at_level(logging.INFO, logger="train"):
        profiler = train(disk, "2:3", steps=4)
    assert profiler.written == [] and written(disk) == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.message for r in warnings]
    assert "cannot be written" in warnings[0].message
    assert "training goes on without it" in warnings[0].message


def test_an_out_of_memory_step_is_one_line_with_the_levers(tmp_path) -> None:
    run = SimpleNamespace(output_dir=str(tmp_path), profile_steps=None, memory_snapshot_step=None)
    torch_said = "CUDA out of memory. Tried to allocate 20.00 GiB.\nGPU 0 has a total capacity"
    with pytest.raises(StepOutOfMemory) as caught:
        with RunProfiler(run, 3, 8, torch.device("cpu"), 41):
            raise torch.OutOfMemoryError(torch_said)
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("rank 3: step 42 ran out of GPU memory (CUDA out of memory. Tried")
    for lever in (
        "--train_batch_size",
        "--activation_checkpointing",
        "--ac_scope mlp",
        "--chunked_loss",
        "--memory_snapshot_step 0",
    ):
        assert lever in line
    assert profiling.MEMORY_LEVERS in line
