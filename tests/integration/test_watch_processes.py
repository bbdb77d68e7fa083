"""Watching a run from outside, on two real gloo ranks (plain `python train.py` processes, each
pinned to its own core):

- a rank made slow from outside (its training thread reniced, a CPU hog pinned to its core) is
  named in a W line, in metrics.jsonl and in the summary; with no hog, no line;
- a rank stopped with SIGSTOP mid-run: the other rank's watchdog writes its stacks to the run
  folder, names the file in the log and ends the rank (exit 4); the stopped rank, continued,
  ends too (no orphan); the newest checkpoint resumes and trains exactly like a run that was
  never stopped.

Three launches in all (the uninterrupted run is both the no-hog case and the resume's
reference); the model is the tiny preset cut to milliseconds per step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import free_port, launch_report, rank_env
from helpers.runs import SMALL_LLAMA, losses, records, run_train

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
# The slowed rank's training thread at nice 10 beside a hog at nice 0 on its core gets ~10% of
# it: ~10x the other's busy time, ~1.8x the median of two on a quiet machine, ~1.5x where other
# work keeps the other rank's core busy too (load 7 on 2 cores: the scheduler moves that work
# off the hogged core). An unslowed pair stays within ~1.1x.
THRESHOLD = "1.35"
SLOW_NICE = 10
HANG_S = 12  # a first step on a loaded 2-core machine can take 4-8 s
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
    "60",
]
LAUNCH_TIMEOUT_S = 240

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin ranks to"),
]


def env_for(rank: int, port: int) -> dict[str, str]:
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM_")}
    env.update(rank_env(rank, 2, port))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    return env


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))[:2]


def start_pinned(argv: list[str], core: int, log: Path, env: dict | None = None):
    """A process pinned to one core, its output into `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )


def start_ranks(out: Path, *extra: str) -> tuple[list[subprocess.Popen], list[Path]]:
    port = free_port()
    argv = [sys.executable, str(REPO / "train.py"), *ARGV, "--output_dir", str(out), *extra]
    logs = [out.parent / f"{out.name}.rank{r}.log" for r in range(2)]
    procs = [start_pinned(argv, cores()[r], logs[r], env_for(r, port)) for r in range(2)]
    return procs, logs


def wait_for(condition, procs: list[subprocess.Popen], what: str, log: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
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
    """The uninterrupted run, no hog: (run folder, rank 0's log)."""
    out = tmp_path_factory.mktemp("watch") / "steady"
    procs, logs = start_ranks(out)
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        stop_all(procs)
    assert codes == [0, 0], logs[0].read_text()[-3000:]
    return out, logs[0].read_text()


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 1 slowed (reniced, a CPU hog on its core) from step 10 until it is named, then
    stopped (SIGSTOP) right after the checkpoint of step 20; rank 0's watchdog ends the job;
    rank 1 is then continued."""
    out = tmp_path_factory.mktemp("watch") / "hung"
    hog = [sys.executable, "-c", "while True: pass"]
    procs, logs = start_ranks(out, "--hang_timeout", str(HANG_S))
    hogs: list[subprocess.Popen] = []
    try:  # the hogs from the first report on: a hogged start-up and first step cost only time
        first = "Batch 10 "
        wait_for(lambda: first in logs[0].read_text(), procs, "the first report", logs[0])
        os.setpriority(os.PRIO_PROCESS, procs[1].pid, SLOW_NICE)  # its main thread
        hogs.append(start_pinned(hog, cores()[1], out.parent / "hog.log"))
        named = "slow rank: rank 1"
        wait_for(lambda: named in logs[0].read_text(), procs, "slow-rank line", logs[0])
        stop_all(hogs)
        # Stopped between saves (a save is not timed: a hang there is --dist_timeout's), with
        # 10 steps to spare before the end
        saved = "Checkpoint step 20 saved"
        wait_for(lambda: saved in logs[0].read_text(), procs, "checkpoint at step 20", logs[0])
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        procs[0].wait(timeout=HANG_S + 60)
        seconds = time.monotonic() - stopped
        os.kill(procs[1].pid, signal.SIGCONT)
        procs[1].wait(timeout=60)  # its peer is gone: it fails at its next collective
    finally:
        stop_all([*hogs, *procs])
    print(f"\nrank 0 ended {seconds:.1f} s after rank 1 was stopped (--hang_timeout {HANG_S})")
    return {
        "out": out,
        "codes": [p.returncode for p in procs],
        "seconds": seconds,
        "logs": [log.read_text() for log in logs],
    }


def test_no_slow_rank_is_named_when_no_rank_is_slowed(steady: tuple[Path, str]) -> None:
    out, log0 = steady
    assert "slow rank:" not in log0
    ratios = [r["slowest_rank_ratio"] for r in records(out)]
    assert len(ratios) == STEPS // 10 and max(ratios) < float(THRESHOLD), ratios
    assert not any(r["slow_rank_named"] for r in records(out))
    assert "slow ranks" not in log0


def test_a_hogged_rank_is_named_in_the_log_and_in_metrics(hung: dict) -> None:
    log0 = hung["logs"][0]
    line = next(x for x in log0.splitlines() if "slow rank:" in x)
    assert " W [" in line and "rank 1 on " in line and "x the median rank's" in line, line
    named = [r for r in records(hung["out"]) if r.get("slow_rank_named")]
    assert named and {r["slowest_rank"] for r in named} == {1}
    assert all(r["slowest_rank_ratio"] > float(THRESHOLD) for r in named)
    assert named[0]["slowest_rank_host"] in line


def test_a_stopped_rank_makes_the_other_write_its_stacks_and_end(hung: dict) -> None:
    out, (log0, log1) = hung["out"], hung["logs"]
    assert hung["codes"][0] == 4, log0[-3000:]
    assert hung["codes"][1] not in (0, None), log1[-3000:]
    assert hung["seconds"] < HANG_S + 30
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
