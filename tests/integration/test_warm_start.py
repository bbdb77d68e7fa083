"""The suite's warm starts (tests/helpers/warm_start.py) behave as the interpreter they stand in
for: the same output and exit status as a cold start, signals passed on, a killed stand-in
ends its program, and whatever a warm start cannot reproduce starts cold."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import PYTHON, process_state
from helpers.runs import SMALL_LLAMA, losses, train_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    PYTHON == sys.executable, reason="no warm-start zygote in this session (LLAMA_TEST_WARM=0)"
)

#: Whether the program found torch already imported: only a child of the zygote does.
PRELOADED = "import sys; print('preloaded' if 'torch' in sys.modules else 'cold')"


def run(python: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**train_env(), **env},
        cwd=ROOT,
    )


def test_a_warm_train_run_prints_and_records_what_a_cold_one_does(tmp_path: Path) -> None:
    flags = [*SMALL_LLAMA, "--bf16=0", "--max_steps=3", "--warmup=1", "--validation_batches=1"]
    results = {}
    for name, python in (("cold", sys.executable), ("warm", PYTHON)):
        out = tmp_path / name
        done = run(python, "train.py", *flags, f"--output_dir={out}")
        assert done.returncode == 0, done.stderr[-3000:]
        batches = [ln.split("] ", 1)[1] for ln in done.stdout.splitlines() if "Loss:" in ln]
        results[name] = (losses(out), [b.split(", Speed")[0] for b in batches])
    assert results["warm"] == results["cold"]
    assert sorted(results["warm"][0]) == [1, 2, 3]


def test_a_refusal_is_the_same_one_line_and_exit_2(tmp_path: Path) -> None:
    argv = ["train.py", "--preset", "tiny", "--max_steps", "0", f"--output_dir={tmp_path}"]
    cold, warm = run(sys.executable, *argv), run(PYTHON, *argv)
    assert cold.returncode == warm.returncode == 2
    assert warm.stderr == cold.stderr and warm.stderr.startswith("train.py: error: --max_steps")
    assert warm.stdout == cold.stdout == ""


def test_the_program_runs_in_a_child_of_the_zygote_unless_the_environment_differs() -> None:
    assert run(PYTHON, "-c", PRELOADED).stdout == "preloaded\n"
    assert run(sys.executable, "-c", PRELOADED).stdout == "cold\n"
    # a variable libraries read while they import: only a fresh interpreter honours it
    assert run(PYTHON, "-c", PRELOADED, HF_HOME="/nonexistent").stdout == "cold\n"
    assert run(PYTHON, "-X", "importtime", "-c", PRELOADED).stdout == "cold\n"
    # what the launcher changes (the venv's bin first on PATH) and benchmarks/' PYTHON are read
    # at run time only: the launcher's workers start warm, and see the PATH they were given
    launched = {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "PYTHON": "python3"}
    assert run(PYTHON, "-c", PRELOADED, **launched).stdout == "preloaded\n"
    shows = "import os; print(os.environ['PATH'], os.environ['PYTHON'])"
    assert run(PYTHON, "-c", shows, **launched).stdout.split() == list(launched.values())


#: How many of 100 allocations of 100 kB (under glibc's default 128 kiB threshold) went through
#: mmap: the growth of mallinfo2's count of mmapped chunks.
MMAPPED = """import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "ar ord sm hblks hd us fsm uord ford keep".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
blocks = [libc.malloc(100_000) for _ in range(100)]
print('preloaded' if 'torch' in sys.modules else 'cold', libc.mallinfo2().hblks - before)
"""


def test_a_memory_tests_malloc_threshold_holds_in_a_warm_child_as_in_a_cold_one() -> None:
    """MALLOC_MMAP_THRESHOLD_ (the gradient-accumulation memory test's: RSS then follows live
    memory) is read by glibc as a process starts; a child of the zygote sets it with mallopt."""
    threshold = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    said = {
        (python, bool(env)): run(python, "-c", MMAPPED, **env).stdout.split()
        for python in (sys.executable, PYTHON)
        for env in (threshold, {})
    }
    for (python, lowered), (start, mmapped) in said.items():
        assert start == ("cold" if python == sys.executable else "preloaded")
        assert int(mmapped) >= 90 if lowered else int(mmapped) < 10, said


def test_exit_codes_and_deaths_by_signal_come_back_as_they_happened() -> None:
    assert run(PYTHON, "-c", "import sys; sys.exit(3)").returncode == 3
    assert run(PYTHON, "-c", "raise ValueError('x')").returncode == 1
    killed = run(PYTHON, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert killed.returncode == -signal.SIGTERM


def test_signals_reach_the_program_and_a_killed_stand_in_ends_it() -> None:
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *_: print('USR1', flush=True))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    # Two threads (it only sleeps): the child's thread pool must not take the process's signals.
    env = {**train_env(), "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(
        [PYTHON, "-u", "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )

    def line() -> str:  # at most 60 s: a lost signal fails the test instead of hanging it
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        return proc.stdout.readline() if ready else "(nothing within 60 s)"

    try:
        child = int(line())
        assert child != proc.pid  # the program is the zygote's child, not the stand-in
        proc.send_signal(signal.SIGUSR1)
        assert line() == "USR1\n"
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 60  # an upper bound for a hung test, not a speed
        while process_state(child) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(child) in ("gone", "Z")  # dead (a zombie until the zygote reaps it)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_torchrun_workers_start_warm_through_python_exec(tmp_path: Path) -> None:
    from helpers.procs import torchrun_cmd

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['RANK'], 'preloaded' if 'torch' in sys.modules else 'cold')\n"
    )
    done = subprocess.run(
        torchrun_cmd(str(script), nproc=2),
        capture_output=True,
        text=True,
        timeout=300,
        env={**train_env(), "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n"))[-2:] == ["0 preloaded", "1 preloaded"]
    assert os.environ.get("PYTHON_EXEC") is None  # only the tests' torchrun sets it
