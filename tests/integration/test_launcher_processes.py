"""scripts/launcher.py with real processes: signals reach workers in their own session (even
before their handler is set), the node exits with torchrun's status (or the failed worker's
own: a refusal's 2, a hang's 4), a stopped worker is ended within the launcher's bound, and
workers end when their launcher is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.procs import process_state

REPO = Path(__file__).resolve().parents[2]

FAKE_TORCHRUN = """#!{python}
# Starts one "worker" in a session of its own (as torchrun does): it inherits torchrun's
# ignored signals, installs its USR1 handler only after a while (importing torch), and exits
# 0 once USR1 reaches it.
import subprocess, sys
worker = '''
import os, signal, sys, time
open(sys.argv[1] + ".started", "w").close()
time.sleep(1.0)
def handle(signum, frame):
    open(sys.argv[1] + ".usr1", "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, handle)
time.sleep(30)
sys.exit(5)
'''
proc = subprocess.Popen([sys.executable, "-c", worker, "{marker}"], start_new_session=True)
sys.exit(proc.wait())
"""


def test_signals_reach_workers_in_their_own_session_even_before_their_handler(
    tmp_path: Path,
) -> None:
    """What Slurm's proctrack/pgid does: signal the task's process group only (launcher and
    torchrun). The launcher passes USR1 on to the worker, again until it has a handler."""
    marker = tmp_path / "worker"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(FAKE_TORCHRUN.format(python=sys.executable, marker=marker))
    torchrun.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LLAMA_REPO_DIR": str(REPO),
        "LLAMA_NNODES": "1",
        "NPROC_PER_NODE": "1",
    }
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    code = (
        "import sys, launcher; launcher.RESEND_EVERY_S = 0.2; sys.exit(launcher.main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "node", "--preset", "tiny"],
        env=env,
        cwd=REPO / "scripts",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180  # ends a hung test; not a speed
        while not Path(f"{marker}.started").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGUSR1)  # the worker is not in this group
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert Path(f"{marker}.usr1").exists(), out
    assert "SIGUSR1 received" in out


def test_the_node_exits_with_torchruns_status(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\nexit 7\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LLAMA_REPO_DIR": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "launcher.py"), "node"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7, result.stdout + result.stderr


def test_a_launch_that_loses_the_run_folder_says_one_line_and_exits_2(tmp_path: Path) -> None:
    """Two launches of one run folder at once both pass the sbatch's check; the one whose rank
    0 finds the folder taken refuses in one line. torchrun then added its own traceback and
    box and exited 1: now the launch exits 2 with the refusal alone. (Real torchrun; the
    winner is a process holding the folder's lock.)"""
    run = tmp_path / "run"
    code = (
        "import sys; from model_utils.run import run_lock; "
        "run_lock.RunLock(sys.argv[1]).acquire(); print('held', flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    winner = subprocess.Popen(
        [sys.executable, "-c", code, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert winner.stdout.readline().strip() == "held"
        path = f"{Path(sys.executable).parent}:{env['PATH']}"  # this venv's torchrun
        loser = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "launcher.py"), "node"]
            + ["--preset", "tiny", "--bf16=0", f"--output_dir={run}"],
            env={**env, "PATH": path, "LLAMA_REPO_DIR": str(REPO), "NPROC_PER_NODE": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        winner.stdin.close()
        winner.wait()
    assert loser.returncode == 2, loser.stderr
    assert "Traceback" not in loser.stderr and "ChildFailedError" not in loser.stderr
    [line] = [ln for ln in loser.stderr.splitlines() if "error" in ln.lower()]
    assert line.startswith(f"train.py: error: {run} is in use by another run (pid {winner.pid} ")


#: A train.py for real torchrun with two workers: rank 1 stops itself (SIGSTOP), rank 0 then
#: ends as a hang does (its line, exit 4). Each writes its pid first.
HUNG_TRAIN = """
import os, signal, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
Path(f"rank{rank}.pid").write_text(str(os.getpid()))
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
while not Path("rank1.pid").exists():
    time.sleep(0.05)
time.sleep(1.0)
print("hang: rank 1 did no training step: ending this rank (exit 4) so the job ends", flush=True)
os._exit(4)
"""

#: A train.py whose two workers train on (sleep) until they are ended.
ENDLESS_TRAIN = """
import os, sys, time
from pathlib import Path
Path(f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def _node(repo: Path, **env: str) -> subprocess.Popen:
    """launcher.py node with real torchrun (this venv's), two workers, `repo` as the checkout."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "LLAMA_REPO_DIR": str(repo), "NPROC_PER_NODE": "2", **env}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    return subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "launcher.py"), "node"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gone(pid: int) -> bool:
    return process_state(pid) in ("gone", "Z")


def test_a_stopped_worker_is_ended_and_the_launch_exits_4_with_the_hang_line(
    tmp_path: Path,
) -> None:
    """Rank 0 ends on a hang (exit 4) while rank 1 is stopped and never acts on torchrun's
    SIGTERM: the launcher kills it TEARDOWN_S after torchrun began stopping it (torchrun
    alone would wait its 30 s grace, then say "Unable to shutdown"), and the launch exits 4
    with rank 0's line and no torchrun traceback."""
    (tmp_path / "train.py").write_text(HUNG_TRAIN)
    node = _node(tmp_path)
    out, err = node.communicate(timeout=300)  # ends a hung test; not a speed
    assert node.returncode == 4, out + err
    assert "hang: rank 1 did no training step" in out
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert "Unable to shutdown" not in err, err  # not torchrun's grace: the launcher's bound
    assert _gone(int((tmp_path / "rank1.pid").read_text()))


def test_workers_end_when_their_launcher_is_killed(tmp_path: Path) -> None:
    """kill -9 of the launcher: torchrun gets its parent-death signal (SIGHUP) and ends its
    workers; nothing trains on headless."""
    (tmp_path / "train.py").write_text(ENDLESS_TRAIN)
    node = _node(tmp_path)
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, node)
        torchrun = parent_of(pids[0])
        node.kill()
        node.wait(timeout=60)
        deadline = time.monotonic() + 120  # ends a hung test; not a speed
        while not all(_gone(pid) for pid in (*pids, torchrun)):
            assert time.monotonic() < deadline, [process_state(p) for p in (*pids, torchrun)]
            time.sleep(0.2)
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def wait_for_pids(folder: Path, node: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 180  # ends a hung test; not a speed
    files = [folder / "rank0.pid", folder / "rank1.pid"]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and node.poll() is None, node.communicate()
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
