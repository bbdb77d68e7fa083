"""The slow rank and the hang watchdog, piece by piece: which rank is named and in what words,
what the summary counts, the busy clock, the watchdog in a real process (it fires, it does not
fire while paused), the Flight Recorder's variables, the flags' refusals.

The two-rank behaviour (a hogged rank named, a stopped rank's peer ending with its stacks, the
resume) is tests/integration/test_watch_processes.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from model_utils.report import slow_rank
from model_utils.run import watchdog

REPO = Path(__file__).resolve().parents[2]


def test_the_slowest_rank_is_named_only_over_the_threshold() -> None:
    hosts = ["a", "a", "b", "b"]
    slow = slow_rank.slowest([1.0, 1.1, 2.4, 1.0], [0.0, 0.0, 0.3, 0.0], hosts, 1.5)
    assert (slow.rank, slow.host, slow.named) == (2, "b", True)
    assert slow.median_seconds == pytest.approx(1.05)
    assert slow.ratio == pytest.approx(2.4 / 1.05)
    assert not slow_rank.slowest([1.0, 1.4], [0, 0], ["a", "b"], 1.5).named
    assert not slow_rank.slowest([1.0, 9.0], [0, 0], ["a", "b"], 0).named  # 0: off


def test_the_line_says_rank_node_window_and_by_how_much() -> None:
    slow = slow_rank.SlowRank(3, "node-7", 0.9, 0.45, 0.2, True)
    line = slow_rank.slow_rank_line(40, 10, slow)
    assert line == (
        "slow rank: rank 3 on node-7 was busy 0.900 s a step over steps 31-40, 2.00x the "
        "median rank's 0.450 s (its data wait 0.200 s a step)"
    )
    fields = slow_rank.record_fields(slow)
    assert fields["slowest_rank"] == 3 and fields["slowest_rank_ratio"] == pytest.approx(2.0)


def test_the_summary_lists_the_ranks_named_most_often() -> None:
    def rec(step: int, rank: int, named: bool) -> dict:
        return {
            "kind": "train",
            "step": step,
            "slowest_rank": rank,
            "slowest_rank_host": f"h{rank}",
            "slow_rank_named": named,
        }

    records = [rec(1, 1, True), rec(2, 3, True), rec(3, 3, True), rec(4, 0, False)]
    records.append(rec(1, 0, False))  # a resume re-logged step 1: its last record counts
    records.append({"kind": "val", "step": 4})
    assert slow_rank.most_often_slow(records) == [(3, "h3", 2)]
    line = slow_rank.summary_line(records)
    assert line == "  slow ranks (reports naming them)  rank 3 on h3 (2x)"
    assert slow_rank.summary_line([rec(1, 0, False)]) is None


def test_busy_time_counts_work_not_sleep() -> None:
    start = slow_rank.busy_seconds()
    time.sleep(0.3)
    slept = slow_rank.busy_seconds() - start
    start = slow_rank.busy_seconds()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    worked = slow_rank.busy_seconds() - start
    assert slept < 0.1 and worked > 0.25, (slept, worked)


def test_the_default_hang_limit_follows_the_step_time_above_a_floor() -> None:
    assert watchdog.auto_limit(None) == watchdog.HANG_FLOOR_S
    assert watchdog.auto_limit(2.0) == watchdog.HANG_FLOOR_S
    assert watchdog.auto_limit(60.0) == 60.0 * watchdog.HANG_STEP_FACTOR
    dog = watchdog.Watchdog(None, "/tmp/unused", 0)
    dog.measured(30.0)
    dog.measured(1.0)  # a faster window never lowers it
    assert dog.limit == 600.0
    fixed = watchdog.Watchdog(12.0, "/tmp/unused", 0)
    fixed.measured(60.0)
    assert fixed.limit == 12.0 and not watchdog.Watchdog(0, "/tmp/unused", 0).enabled


def run_dog(tmp_path: Path, body: str, start: str = "dog.start()") -> subprocess.CompletedProcess:
    """A real process that makes a Watchdog (limit 0.5 s, rank 3), runs ``start`` then ``body``."""
    code = textwrap.dedent(
        f"""
        import logging, sys, time
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        from model_utils.run.watchdog import Watchdog
        dog = Watchdog(0.5, {str(tmp_path)!r}, 3)
        def stuck_in_a_collective():
            time.sleep(30)
        """
    )
    code += textwrap.dedent(start) + "\n" + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_the_watchdog_writes_the_stacks_names_the_file_and_ends_the_rank(tmp_path) -> None:
    result = run_dog(tmp_path, "stuck_in_a_collective()\n")
    assert result.returncode == watchdog.EXIT_HUNG, result.stderr
    stacks = tmp_path / "hang" / "stacks.rank3.txt"
    text = stacks.read_text()
    assert text.startswith("rank 3: no training step done for ")
    assert "stuck_in_a_collective" in text
    assert f"its Python stacks are in {stacks}" in result.stdout


def test_a_stuck_preflight_ends_the_rank_named_and_a_finished_one_leaves_training_watched(
    tmp_path,
) -> None:
    """train.py runs the preflight inside ``watching``: a rank stuck there ends at the limit
    (not at --dist_timeout) and says it was the preflight; a preflight that finished leaves
    the training watch armed (its stop reset), naming a training step again."""
    watch = "with dog.watching('preflight collective'):\n    "
    stuck = run_dog(tmp_path / "stuck", "", start=watch + "stuck_in_a_collective()")
    assert stuck.returncode == watchdog.EXIT_HUNG, stuck.stderr
    assert "hang: rank 3 did no preflight collective for " in stuck.stdout
    text = (tmp_path / "stuck" / "hang" / "stacks.rank3.txt").read_text()
    assert text.startswith("rank 3: no preflight collective done for ")
    assert "stuck_in_a_collective" in text
    after = run_dog(tmp_path / "after", "stuck_in_a_collective()", watch + "pass\ndog.start()")
    assert after.returncode == watchdog.EXIT_HUNG, after.stderr
    assert "hang: rank 3 did no training step for " in after.stdout


def test_the_watchdog_does_not_fire_while_paused_or_stepping(tmp_path) -> None:
    body = """
    with dog.paused():
        time.sleep(1.5)
    for _ in range(15):
        time.sleep(0.1)
        dog.step_done()
    dog.close()
    print("done")
    """
    result = run_dog(tmp_path, body)
    assert result.returncode == 0 and "done" in result.stdout, result.stdout + result.stderr
    assert not (tmp_path / "hang" / "stacks.rank3.txt").exists()


def test_flight_recorder_variables_point_into_the_run_folder(tmp_path) -> None:
    """Under the names the running torch reads, and only those: torch 2.11 warns on every
    rank's stderr about the older names (a second line beside a one-line refusal)."""
    prefix = str(tmp_path.absolute() / "flight_recorder" / "rank_")
    assert watchdog.flight_recorder_env(tmp_path, {}, release=(2, 11)) == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    assert watchdog.flight_recorder_env(tmp_path, {}, release=(2, 6)) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"}
    kept = watchdog.flight_recorder_env(tmp_path, mine, release=(2, 11))
    assert kept["TORCH_FR_BUFFER_SIZE"] == "500" and kept["TORCH_FR_DUMP_TEMP_FILE"] == "/x/t_"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--slow_rank_threshold", "1"], "--slow_rank_threshold is a ratio"),
        (["--slow_rank_threshold", "nan"], "--slow_rank_threshold is a ratio"),
        (["--hang_timeout", "-1"], "--hang_timeout must be >= 1 seconds (0: off), got -1"),
        (["--hang_timeout", "inf"], "--hang_timeout must be >= 1"),
        # under a second, the run ended itself before its first step could finish
        (["--hang_timeout", "0.001"], "--hang_timeout must be >= 1 seconds (0: off), got 0.001"),
    ],
)
def test_bad_values_are_refused_in_one_line(refused_by_train, flags, words) -> None:
    _, lines, _ = refused_by_train("--preset", "tiny", *flags)
    assert len(lines) == 1 and words in lines[0], lines
