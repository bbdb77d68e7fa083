"""Tiers: ``make test`` is the CPU tier; ``pytest -m gpu tests/integration/test_gpu.py`` the GPU
tier.

The CPU tier must behave the same on a laptop, in CI and on a GPU node (no test may fail just
because a GPU or Transformer Engine is present), so unless the run selects the ``gpu`` marker,
CUDA devices are hidden from this process and the subprocesses it starts, before torch
initialises CUDA. GPU-tier tests skip themselves without a GPU.

``make test`` runs the CPU tier on two pytest-xdist workers, one test module at a time per
worker (``--dist loadscope --no-loadscope-reorder``), in the order this file collects them: the
modules that take minutes first, so that the workers finish together instead of one waiting
alone on the Slurm end-to-end tests at the end.

Shared fixtures live here; plain helpers (ports, launching ranks, runs, checkpoints, ...) in the
``tests/helpers`` package (``from helpers.procs import ...``).
"""

from __future__ import annotations

import gc
import os
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: The modules that take minutes on 2 CPU cores, longest first (their tests' summed times in
#: fresh-clone `make test` runs, benchmarks/results/2026-12-05-make-test.md: the long A/B's
#: dry run made test_parity_run one of the three longest). Every other module keeps its place
#: after them. Only the schedule depends on this list, never a result.
LONGEST_FIRST = (
    "integration/test_container_e2e.py",  # image build, enroot import, two Pyxis jobs
    "integration/test_parity_run.py",  # five long-A/B arms through the launcher, twin pairs
    "integration/test_train.py",
    "integration/test_slurm_e2e.py",
    "integration/test_low_bit_optim_processes.py",
    "integration/test_distributed.py",
    "integration/test_failures_processes.py",
    "integration/test_sbatch_without_a_cluster.py",
    "integration/test_trackers_processes.py",
    "integration/test_cross_impl_processes.py",
)


#: Intra-op threads of every process the CPU tier runs: tests in this process and every process
#: they start. The pytest workers already fill the cores, and a process's second thread only
#: waits for a core: OpenMP's barriers under oversubscription made a 14-s train.py run take
#: 67 s beside the other worker (benchmarks/results/2026-12-01-make-test.md). One count for
#: all also keeps runs that are compared bit for bit on the same reduction order. The Slurm
#: and sbatch paths drop it (helpers.slurm.clean_env): there the launcher sets its own.
TEST_THREADS = {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):
        _check_free_disk(config)
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update(TEST_THREADS)
        if _runs_tests(config):
            import torch

            torch.set_num_threads(1)
        if _runs_tests(config) and os.environ.get("LLAMA_TEST_WARM", "1") != "0":
            _start_zygote(config)  # the GPU tier starts its runs with sys.executable


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, transformers, the recipe: millions of objects) is moved
    out of the cyclic collector's reach: each full collection in a test walked all of it
    (benchmarks/results/2026-12-06-make-test.md). The tests' own objects are collected as ever."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    zygote = getattr(config, "_warm_zygote", None)
    if zygote is not None:
        zygote.stdin.close()  # the zygote's signal to stop
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
        import shutil

        shutil.rmtree(config._warm_folder, ignore_errors=True)  # the stand-in, socket, log


def _check_free_disk(config) -> None:
    """A run of the whole tier stops before its first test, exit code 2, when the disk of its
    temporary folder cannot hold what the suite writes (helpers.disk)."""
    import tempfile

    from helpers import disk

    given = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    if TESTS not in given:
        return
    root = config.option.basetemp or os.environ.get("PYTEST_DEBUG_TEMPROOT")
    short = disk.shortage(
        {Path(root or tempfile.gettempdir()): disk.TMP_NEED_GIB}, "point TMPDIR at a larger disk"
    )
    if short:
        pytest.exit(short, returncode=2)


def _runs_tests(config) -> bool:
    """This process runs tests: an xdist worker, or a run without workers (-n 0)."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def _start_zygote(config) -> None:
    """This process's warm-start zygote (tests/helpers/warm_start.py): Python processes the
    tests start through ``helpers.procs.PYTHON`` fork from it with torch, transformers and the
    recipe imported. It imports in the background; a process started before it is ready
    waits for it. ``LLAMA_TEST_WARM=0`` starts every process cold."""
    import sys
    import tempfile

    from helpers import warm_start

    folder = Path(tempfile.mkdtemp(prefix="llama-warm-"))
    stand_in = warm_start.write_stand_in(str(folder), sys.executable)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    for name in (warm_start.SOCKET_ENV, warm_start.PID_ENV):
        env.pop(name, None)
    with open(folder / "zygote.log", "wb") as log:  # the zygote keeps its own descriptor
        zygote = subprocess.Popen(
            [sys.executable, warm_start.__file__, "--zygote", str(folder / "zygote.sock")],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=TESTS.parent,
        )
    config._warm_zygote, config._warm_folder = zygote, folder
    os.environ[warm_start.SOCKET_ENV] = str(folder / "zygote.sock")
    os.environ[warm_start.PID_ENV] = str(zygote.pid)
    os.environ[warm_start.REAL_PYTHON_ENV] = sys.executable
    os.environ[warm_start.STAND_IN_ENV] = stand_in


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Each house rule's headroom (helpers.house) after a run that includes its test (``make
    test``, or tests/unit/test_house.py alone): how close the fullest room is before it fails."""
    house = TESTS / "unit" / "test_house.py"
    given = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    if not any(path == house or path in house.parents for path in given):
        return
    from helpers.house import headroom

    terminalreporter.write_sep("-", "house rules: headroom")
    for line in headroom():
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items) -> None:
    """Longest modules first (a stable sort: the rest keep their collected order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def position(item) -> int:
        path = Path(item.path)
        module = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
        return rank.get(module, len(LONGEST_FIRST))

    items.sort(key=position)


@pytest.fixture
def te_double(monkeypatch):
    """``import transformer_engine`` loads the TE test double (tests/te_double) in this test.

    The double starts from TE's default policy for pickled FP8 state: a user's
    ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` does not leak in (tests that need it set it)."""
    from te_double import install, uninstall

    from model_utils.precision.te_requirements import TE_UNSAFE_PICKLE_ENV

    monkeypatch.delenv(TE_UNSAFE_PICKLE_ENV, raising=False)
    install()
    yield
    uninstall()


@pytest.fixture
def refused_by_train(capsys):
    """``refused_by_train(*argv)``: ``train.main(argv)`` in this process, for input train.py
    refuses before it starts anything (no process group, no file). Asserts the exit status 2
    and returns (stdout, the ``train.py: error:`` lines of stderr, all of stderr).

    The exit through the interpreter is tested once per entry point by a subprocess test; these
    spare the ~3 s start of one. ``--validate_only`` is appended (a launch flag: it changes no
    check), so input that is wrongly accepted returns at once instead of training inside
    pytest. The signal handlers and logging set-up main() installs are put back."""
    import logging
    import signal

    import train

    def run(*argv: str) -> tuple[str, list[str], str]:
        sigs = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
        handlers = {sig: signal.getsignal(sig) for sig in sigs}
        root = logging.getLogger()
        logging_setup = (root.handlers[:], root.level)
        capsys.readouterr()
        try:
            with pytest.raises(SystemExit) as exit_:
                train.main([*argv, "--validate_only"])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            root.handlers[:], level = logging_setup
            root.setLevel(level)
        out, err = capsys.readouterr()
        assert exit_.value.code == 2, err
        lines = [ln for ln in err.splitlines() if ln.startswith("train.py: error:")]
        return out, lines, err

    return run


@pytest.fixture
def small_disk(tmp_path: Path):
    """Mount tmpfs file systems of a given size (MiB) or read-only, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(name: str, size_mib: float, read_only: bool = False, inodes: int = 0) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={round(size_mib * 1024)}k" + (",ro" if read_only else "")
        options += f",nr_inodes={inodes}" if inodes else ""
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"needs root allowed to mount a tmpfs: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)
