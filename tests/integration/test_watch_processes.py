"""Watching a run from outside, on two real gloo ranks (plain `python train.py` processes):

- a rank whose busy time runs ten times the other's is named in a W line, in metrics.jsonl and
  in the summary; with equal busy times, no line;
- a rank that stops (SIGSTOP, sent by itself as step 21 begins, so never inside a checkpoint's
  collectives) mid-run: the other rank's watchdog writes its stacks to the run
  folder, names the file in the log and ends the rank (exit 4); the stopped rank, continued,
  ends too (no orphan); the newest checkpoint resumes and trains exactly like a run that was
  never stopped.

The ranks' busy clocks are driven (``slow_rank.busy_seconds`` counts its calls, times a
per-rank factor), so what the gather, the W line, the records and the summary see does not
depend on what else the machine runs; reading the real clock (schedstat) is
tests/unit/test_watch.py's. The hang limit is far above a step of this model on a loaded
machine, so only the stop ends the run. Three launches in all (the uninterrupted run is both the
equal-clocks case and the resume's reference); the model is the tiny preset cut to milliseconds
per step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import doc_logs
from helpers.procs import PYTHON, free_port, launch_report, process_state, rank_env
from helpers.runs import SMALL_LLAMA, losses, records, run_train

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
THRESHOLD = "1.35"
#: Busy seconds per call of the driven clock, by rank: the slowed rank's are ten times the
#: other's (its ratio to the median of two is 20/11 = 1.82).
SLOWED = (1.0, 10.0)
STEADY = (1.0, 1.0)
#: The hang limit: a step of this model takes milliseconds, a first step on a loaded 2-core
#: machine up to ~8 s; only a stopped rank goes 30 s without one.
HANG_S = 30
ARGV = [
    *SMALL_LLAMA,
    "--train_batch_size",
    "4",
    "--bf16=0",
    "--max_steps",
    str(STEPS),
    "--warmup",
    "2",
    "--logging_freq",
    "10",
    "--checkpoint_freq",
    "10",
    "--keep_last",
    "0",
    "--slow_rank_threshold",
    THRESHOLD,
    "--dist_timeout",
    "120",
]
LAUNCH_TIMEOUT_S = 300

#: train.py with the slow-rank clock driven (each call of busy_seconds adds FACTOR x 10 ms) and,
#: where STOP_AT is a step, a SIGSTOP the rank sends itself as that step begins: a stop in
#: training, never inside a checkpoint's collectives (those are --dist_timeout's, not the
#: watchdog's: docs/hangs.md), whatever the machine's load. STOP_AT -1: as the preflight begins.
DRIVEN = """\
import os, signal, sys
from model_utils.parallel import preflight
from model_utils.report import slow_rank
import train
factor, stop_at, calls, steps = float(sys.argv[1]), int(sys.argv[2]), [0], [0]
def driven():
    calls[0] += 1
    return calls[0] * 0.01 * factor
def step(*args, **kwargs):
    steps[0] += 1
    if steps[0] == stop_at:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real_step(*args, **kwargs)
slow_rank.busy_seconds = driven
def check(*args, **kwargs):
    if stop_at == -1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real_check(*args, **kwargs)
real_step, train.train_step = train.train_step, step
real_check, preflight.check = preflight.check, check
train.main(sys.argv[3:])
"""
STOP_AT = 21  # after the checkpoint of step 20, with 10 steps to spare before the end

pytestmark = pytest.mark.slow


def env_for(rank: int, port: int) -> dict[str, str]:
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM_")}
    env.update(rank_env(rank, 2, port))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    return env


def start_ranks(
    out: Path,
    factors: tuple[float, float],
    *extra: str,
    stops: tuple[int, int] = (0, 0),
    python: str = PYTHON,
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two ranks of train.py with driven busy clocks, each stopping itself at the step in
    ``stops`` (0: never); ``python=sys.executable`` where the test signals the process itself
    (a warm start's stand-in cannot pass SIGCONT to a stopped child it does not know)."""
    port = free_port()
    logs = [out.parent / f"{out.name}.rank{r}.log" for r in range(2)]
    procs = []
    for rank, (factor, stop) in enumerate(zip(factors, stops, strict=True)):
        argv = [python, "-c", DRIVEN, str(factor), str(stop), *ARGV, "--output_dir", str(out)]
        argv += extra
        with logs[rank].open("w") as log:
            procs.append(
                subprocess.Popen(
                    argv, env=env_for(rank, port), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                )
            )
    return procs, logs


def wait_for(condition, procs: list[subprocess.Popen], what: str, log: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S  # ends a hung test; not a speed
    while time.monotonic() < deadline:
        if condition():
            return
        exited = [p.returncode for p in procs if p.poll() is not None]
        assert not exited, f"exited ({exited}) before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} in {LAUNCH_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # also a stopped process
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted run, equal busy clocks: (run folder, rank 0's log)."""
    out = tmp_path_factory.mktemp("watch") / "steady"
    procs, logs = start_ranks(out, STEADY)
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        stop_all(procs)
    assert codes == [0, 0], logs[0].read_text()[-3000:]
    return out, logs[0].read_text()


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 1's busy clock at ten times rank 0's; rank 1 stops itself (SIGSTOP) as step
    STOP_AT begins; rank 0's watchdog ends the job; rank 1 is then continued."""
    out = tmp_path_factory.mktemp("watch") / "hung"
    procs, logs = start_ranks(
        out, SLOWED, "--hang_timeout", str(HANG_S), stops=(0, STOP_AT), python=sys.executable
    )
    try:
        wait_for(lambda: process_state(procs[1].pid) == "T", procs, "rank 1 stopped", logs[1])
        procs[0].wait(timeout=HANG_S + 120)  # ends a hung test; not a speed
        os.kill(procs[1].pid, signal.SIGCONT)
        procs[1].wait(timeout=180)  # its peer is gone: it fails at its next collective
    finally:
        stop_all(procs)
    return {
        "out": out,
        "codes": [p.returncode for p in procs],
        "logs": [log.read_text() for log in logs],
    }


def test_no_slow_rank_is_named_when_no_rank_is_slowed(steady: tuple[Path, str]) -> None:
    out, log0 = steady
    assert "slow rank:" not in log0
    ratios = [r["slowest_rank_ratio"] for r in records(out)]
    assert ratios == [1.0] * (STEPS // 10), ratios  # equal clocks: every rank the median
    assert not any(r["slow_rank_named"] for r in records(out))
    assert "slow ranks" not in log0


def test_a_rank_ten_times_busier_is_named_in_the_log_and_in_metrics(hung: dict) -> None:
    log0 = hung["logs"][0]
    line = next(x for x in log0.splitlines() if "slow rank:" in x)
    assert " W [" in line and "rank 1 on " in line and "x the median rank's" in line, line
    named = [r for r in records(hung["out"]) if r.get("slow_rank_named")]
    assert named and {r["slowest_rank"] for r in named} == {1}
    assert all(r["slowest_rank_ratio"] > float(THRESHOLD) for r in named)
    assert named[0]["slowest_rank_host"] in line
    checked, wrong = doc_logs.tag_mismatches(log0)  # docs/hangs.md's slow-rank and hang lines
    assert checked >= 2 and wrong == [], wrong


def test_a_stopped_rank_makes_the_other_write_its_stacks_and_end(hung: dict) -> None:
    out, (log0, log1) = hung["out"], hung["logs"]
    assert hung["codes"][0] == 4, log0[-3000:]
    assert hung["codes"][1] not in (0, None), log1[-3000:]
    stacks = out / "hang" / "stacks.rank0.txt"
    text = stacks.read_text()
    assert "no training step done for" in text and 'File "' in text, text
    assert "train.py" in text  # the main thread's stack reaches the training loop
    # Rank 1, continued, ends too: by its own watchdog (its clock ran on while it was stopped,
    # its stacks show where it stood) or by the collective its peer left.
    assert f"its Python stacks are in {stacks}" in log0


def test_the_checkpoint_before_a_hang_resumes_exactly(steady, hung: dict) -> None:
    out = hung["out"]
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept, "no checkpoint before the hang"
    saved = int(kept[-1].removeprefix("step_"))
    assert 20 <= saved < STEPS
    result = run_train(*ARGV, "--output_dir", str(out), "--resume_from_checkpoint", "auto", nproc=2)
    assert result.returncode == 0, launch_report(result)
    resumed, reference = losses(out), losses(steady[0])
    after = [s for s in reference if s > saved]
    assert after and all(resumed[s] == reference[s] for s in after), (saved, resumed, reference)


def test_stack_file_names_are_in_the_start_up_line(hung: dict) -> None:
    start = next(x for x in hung["logs"][0].splitlines() if "hang watchdog:" in x)
    assert f"{hung['out'] / 'hang' / 'stacks.rank<R>.txt'}" in start
    assert f"no step done in {HANG_S} s (--hang_timeout)" in start


def test_a_rank_that_never_joins_the_preflight_ends_the_job_named(tmp_path: Path) -> None:
    """`--preflight full`, rank 1 stopped as its preflight begins: rank 0, waiting in the
    preflight's collectives, ends at --hang_timeout with its stacks and a line naming the
    preflight, not at --dist_timeout (120 s) with neither."""
    out = tmp_path / "stuck"
    extra = ("--preflight", "full", "--hang_timeout", "10")
    procs, logs = start_ranks(out, STEADY, *extra, stops=(0, -1), python=sys.executable)
    try:
        wait_for(lambda: process_state(procs[1].pid) == "T", procs, "rank 1 stopped", logs[1])
        code = procs[0].wait(timeout=100)  # before --dist_timeout would have ended it
    finally:
        stop_all(procs)
    log0 = logs[0].read_text()
    assert code == 4, log0[-3000:]
    assert "hang: rank 0 did no preflight collective for " in log0, log0[-3000:]
    stacks = (out / "hang" / "stacks.rank0.txt").read_text()
    assert stacks.startswith("rank 0: no preflight collective done for "), stacks
    assert "preflight.py" in stacks  # where rank 0 stood
