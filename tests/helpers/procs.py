"""Process helpers shared by the tests: free ports, the one way tests start ranks, interrupts.

Multi-process tests start their ranks in one of two ways, both here:

* a script (``train.py``, ``tests/dist_scripts/*.py``) under torchrun: :func:`torchrun_cmd`;
  a hand launch of such a script without an agent gets torchrun's variables from
  :func:`rank_env`;
* a function of the test module in ``world_size`` processes: :func:`spawn_ranks` (each rank
  joins the gloo group on the port it is given).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

#: The interpreter tests start Python processes with where the start-up is not what they test:
#: the warm-start stand-in of tests/helpers/warm_start.py (a fork of a process that has
#: imported torch, transformers and the recipe) when the session runs a zygote (conftest.py),
#: else this interpreter. Tests of an entry point's own start use ``sys.executable``.
PYTHON = os.environ.get("LLAMA_TEST_WARM_PYTHON", sys.executable)


def warm_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with torchrun's workers started through PYTHON."""
    return {**(os.environ if env is None else env), "PYTHON_EXEC": PYTHON}


def warm_venv(folder: Path) -> dict[str, str]:
    """The variables under which a launch (``bash 1.train_llama.sbatch``, the GPU scripts)
    starts every Python process of its own warm: ``VENV``, a folder made here whose
    ``bin/python`` (and ``python3``) is PYTHON and whose ``bin/torchrun`` is torchrun's module
    on PYTHON, and ``PYTHON_EXEC`` for torchrun's workers. The launcher's own check
    (``train.py --validate_only``) and its agent then fork from the zygote like the workers.
    Without a zygote, nothing: the launch uses the checkout's .venv. Not for a test that
    signals the launcher (its forwarder finds the workers as torchrun's children, and a warm
    torchrun's are the zygote's), nor for one that sets import-time variables the stand-in
    would start cold anyway."""
    if PYTHON == sys.executable:
        return {}
    bin_dir = folder / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir(parents=True)
        for name in ("python", "python3"):
            (bin_dir / name).symlink_to(PYTHON)
        torchrun = bin_dir / "torchrun"
        torchrun.write_text(f'#!/bin/sh\nexec "{PYTHON}" -m torch.distributed.run "$@"\n')
        torchrun.chmod(0o755)
    return {"VENV": str(folder), "PYTHON_EXEC": PYTHON}


def free_port(low: int = 0, high: int = 0) -> int:
    """A TCP port nobody listens on: the first free one in [low, high), or by default one from
    this pytest-xdist worker's own block (:func:`worker_ports`), tried from a random start."""
    if high:
        candidates = list(range(low, high))
    else:
        block = worker_ports()
        start = random.randrange(len(block))
        candidates = [*block[start:], *block[:start]]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{min(candidates)}, {max(candidates)}]")


def worker_ports() -> range:
    """2000 ports for this pytest-xdist worker (gw0: 21000-22999, gw1: 23000-24999, ...; four
    blocks, then they repeat), so that two workers never pick the same rendezvous port between
    choosing it and the launched process binding it. All lie below the kernel's ephemeral range
    (32768+), where the other worker's gloo connections take their local ports, and clear of
    the ports the launchers derive from a Slurm job id (20000 + id, 29500 + id % 1000)."""
    number = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(number) if number.isdigit() else 0
    low = 21000 + 2000 * (index % 4)
    return range(low, low + 2000)


def torchrun_cmd(
    *argv: str, nproc: int, launcher: tuple[str, ...] | None = None, python: str = PYTHON
) -> list[str]:
    """``torchrun --nproc_per_node=NPROC`` of ``argv`` (a script and its flags) on this host.

    ``launcher`` replaces the single-node rendezvous (127.0.0.1 and a free port), e.g. with
    ``--nnodes=2`` and a c10d endpoint for two agents. The agent starts warm (``python``);
    its workers do where the environment says so (``PYTHON_EXEC``: :func:`warm_env`). A test
    that finds the workers as the agent's child processes passes ``python=sys.executable``."""
    if launcher is None:
        launcher = ("--master_addr=127.0.0.1", f"--master_port={free_port()}")
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        *launcher,
        *argv,
    ]


def rank_env(rank: int, world_size: int, port: int | str) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-node world (for hand launches)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def spawn_ranks(worker, world_size: int, *args) -> None:
    """Run ``worker(rank, world_size, port, *args)`` in ``world_size`` processes and wait.

    ``worker`` is a module-level function (it is pickled by name); ``port`` is free for the
    gloo rendezvous. A rank that raises fails the call. The ranks are forked from
    multiprocessing's fork server, which has imported torch and torch.distributed once per
    pytest process (fresh interpreters, mp.spawn's way, spend seconds of CPU each on it)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
    mp.start_processes(
        _rank_main,
        args=(worker, world_size, free_port(), *args),
        nprocs=world_size,
        start_method="forkserver",
    )


#: What spawn_ranks' fork server imports before it forks a rank.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "helpers.procs"]


def _rank_main(rank: int, worker, world_size: int, port: int, *args) -> None:
    """One spawned rank: the worker, then an exit that skips interpreter shutdown.

    Why: gloo's worker threads drop a finished collective's tensors a moment after it returns,
    and that needs the GIL. Once a DTensor op has run (fully_shard runs one), torch 2.13 keeps
    the gloo group and its threads alive past ``destroy_process_group``, and CPython 3.11 ends
    a thread that asks for the GIL during shutdown by unwinding it through a C++ destructor:
    std::terminate, SIGABRT, and a rank that finished its work reported as crashed (seen in
    CI; 1 run in 19 of the two-rank FSDP2 test here, 0 in 50 with this exit). Skipping
    shutdown leaves no moment at which that can happen
    (model_utils.parallel.distributed.cleanup only narrows it). A worker that raises still goes
    through ``mp.spawn``'s own error path.
    """
    worker(rank, world_size, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_report(result: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed torchrun launch printed, for an assertion message: every rank's traceback
    lines (torchrun prefixes them ``[rankN]:``; the tail alone would show only the last rank to
    die, not the one that failed first), then the tail of stdout and stderr."""
    ranks = [line for line in result.stderr.splitlines() if line.startswith("[rank")][:120]
    tails = ["--- stdout tail ---", result.stdout[-tail:], "--- stderr tail ---"]
    return "\n".join([*ranks, *tails, result.stderr[-tail:]])


def signal_after(
    cmd: list[str], sig: signal.Signals, marker: str = "Batch 2 Loss", timeout: float = 120, **popen
) -> tuple[int, str]:
    """Run ``cmd``, send ``sig`` once ``marker`` appears in its output, and wait for the exit.

    Returns (exit status, everything it printed). The process is killed if it outlives
    ``timeout`` or the test fails.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                proc.send_signal(sig)
        status = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, "".join(seen)


def script_refusal(main, name: str, argv: list[str], capsys, status: int = 2) -> str:
    """The one line of a script's refusal (`main(argv)` of scripts/NAME): the exit status,
    nothing on stdout, no traceback, the line prefixed with the script's name."""
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{name}: error: ")
    return err


def processes_mentioning(text: str) -> list[str]:
    """The command lines of every live process whose arguments contain `text` (orphans)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def process_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped, Z: dead and not yet reaped), or
    "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"
