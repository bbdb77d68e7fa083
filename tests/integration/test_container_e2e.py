"""The container path, executed: 0.transformer-engine.dockerfile -> Docker image -> `enroot
import` squash file -> Pyxis `srun --container-image` on a real two-node Slurm cluster ->
`sbatch --nodes=2 1.train_llama.sbatch --preset tiny --fp8=1` -> preemption -> a resume with
the losses, bit for bit, of the same run on the host's venv without the container.

tools/container_e2e.sh does the work: enroot 4.1.2 and Pyxis 0.24.0 built from their release
tarballs (../shared/container, or CONTAINER_SOURCES), a Docker daemon of its own, the recipe's
Dockerfile built unchanged except its base (a stand-in for the NGC image: Debian's Python, the
pinned CPU torch, the TE test double registered as the `transformer_engine` distribution, an
NGC-like /etc/pip/constraint.txt), `enroot import dockerd://`, and tools/slurm_cluster.sh's
two-node cluster with Pyxis in its plugstack. What this proves and what it cannot (the NGC
image's own contents, GPUs, NCCL, EFA): docs/cluster.md.

Needs root, Debian's packages (tools/install_test_deps.sh installs them) and the tarballs;
without them it skips and says why, except in CI (CI=true), where that is a failure.

Budget (2 CPU cores): the build ~40 s (the Debian root file system, the torch wheel, the
stand-in base and the recipe image's steps are cached in ~/.cache/llama-fp8-container; a changed
Dockerfile or requirements.txt adds ~1 min, a first build ~2.5 min), the host's run ~15 s, the
preempted job and its requeue ~1.5 min."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import disk
from helpers.procs import processes_mentioning
from helpers.runs import run_train
from helpers.slurm import (
    FINAL_LOSS,
    IN_CI,
    STEPS,
    Cluster,
    Job,
    check_both_nodes_ran,
    check_two_node_preemption,
    clean_env,
    preempt_and_check_exact_resume,
    rank_lines,
    seed_losses,
    skip_or_fail,
    submit_two_nodes,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "container_e2e.sh"
INSTALL_DEPS = REPO / "tools" / "install_test_deps.sh"
SOURCES = Path(os.environ.get("CONTAINER_SOURCES", REPO.parent / "shared" / "container"))
TARBALLS = ("enroot-4.1.2.tar.gz", "pyxis-0.24.0.tar.gz")

FP8_ARGS = [
    "--preset",
    "tiny",
    "--max_steps",
    str(STEPS),
    "--warmup",
    "2",
    "--fp8=1",
    # FP8 emulated in fp32 (torchao's emulation is fp32 matmuls either way): what the container
    # path tests is the image and Slurm, and the rest of a bf16 model's matmuls run tens of
    # times slower than fp32 on a CPU without bf16 units
    "--bf16=0",
    "--train_batch_size",
    "2",
    "--max_context_width",
    "64",
]
# "0: container: ip-10-1-2-11: Python 3.11.2 (/usr/bin/python), torch 2.13.0+cpu,
#  transformer_engine 2.16.0+double" (srun --label: task 0 = node 0), from inside the image
CONTAINER_LINE = re.compile(
    r"^(\d+): container: (\S+): Python (\S+) \((\S+)\), torch (\S+), transformer_engine (\S+)$",
    re.M,
)


def run_script(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def test_bad_arguments_get_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, message in (
        (["stop", str(tmp_path)], "is not a state folder of container_e2e.sh"),
        (["stop"], "is not a state folder of container_e2e.sh"),
    ):
        result = run_script(*args, timeout=30)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (tmp_path / "someone-elses-file").touch()
    if os.geteuid() == 0:
        result = run_script("build", str(tmp_path), timeout=30)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (tmp_path / "someone-elses-file").exists()


def test_missing_tarballs_are_named_in_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the prerequisites are checked as root only")
    result = subprocess.run(
        [str(SCRIPT), "build", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(CONTAINER_SOURCES=str(tmp_path)),
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # (the tools are checked first: on a machine without them, that is the line)
    assert f"no {TARBALLS[0]} and {TARBALLS[1]} in {tmp_path}" in result.stderr or (
        "install_test_deps.sh" in result.stderr
    ), result.stderr
    assert not (tmp_path / "state").exists()


# --------------------------------------------------------------------------------------
# The whole path


def build(state: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = run_script("build", str(state), timeout=1500)
    return result, time.monotonic() - started


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """`container_e2e.sh build`: the state folder and the script's log (phases and times)."""
    if os.geteuid() != 0:
        skip_or_fail("needs root: dockerd, mounts and slurmd")
    if not all((SOURCES / name).is_file() for name in TARBALLS):
        # A skip even in CI: a clone without the sources beside it cannot build enroot/Pyxis.
        pytest.skip(f"no {' and '.join(TARBALLS)} in {SOURCES} (set CONTAINER_SOURCES)")
    cache = disk.container_cache()
    if not (cache / "docker").is_dir():  # a first build writes the whole cache
        short = disk.shortage(
            {cache: disk.CONTAINER_CACHE_NEED_GIB}, "set CONTAINER_CACHE to a larger disk"
        )
        if short:
            pytest.fail(short, pytrace=False)
    state = tmp_path_factory.mktemp("container-e2e")
    result, seconds = build(state)
    if result.returncode == 2 and "install_test_deps.sh" in result.stderr:
        if shutil.which("apt-get") is None:
            skip_or_fail(f"{result.stderr.strip()} (and there is no apt-get)")
        subprocess.run([str(INSTALL_DEPS)], check=True, timeout=900)
        result, seconds = build(state)
    try:
        if result.returncode == 2 and not IN_CI:
            pytest.skip(result.stderr.strip())
        assert result.returncode == 0, result.stderr
        yield state, f"{result.stderr}\nbuild: {seconds:.0f} s"
    finally:
        subprocess.run([str(SCRIPT), "stop", str(state), "--purge"], timeout=300)


@pytest.fixture(scope="module")
def cluster(built: tuple[Path, str]) -> Cluster:
    state, _ = built
    # proctrack/pgid: Slurm signals only each node's launcher (inside the container), which
    # must pass a preemption on to its workers.
    started = subprocess.run(
        [str(SCRIPT), "start", str(state)],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(SLURM_CLUSTER_PROCTRACK="pgid"),
    )
    assert started.returncode == 0, started.stderr
    exports = dict(re.findall(r"(\w+)=(\S+)", started.stdout))
    assert Path(exports["IMAGE"]) == state / "transformer-engine.sqsh", started.stdout
    # The jobs' environment: the image, no Hugging Face cache of ours (the launcher must give
    # the read-only container one on the host), a home of the test's own.
    home = state / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in clean_env(SLURM_CONF=exports["SLURM_CONF"]).items()
        if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")
    }
    env.update(IMAGE=exports["IMAGE"], HOME=str(home))
    return Cluster(state / "slurm", env)


@pytest.fixture(scope="module")
def host_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same FP8 run uninterrupted on this host's venv (torchrun, two workers of one thread,
    as the two nodes' one worker each): the losses the container job must have, bit for bit,
    before its preemption and after its resume. Its log."""
    out = tmp_path_factory.mktemp("host-reference") / "run"
    return run_train(*FP8_ARGS, f"--output_dir={out}", nproc=2).stdout


@pytest.fixture(scope="module")
def preempted_job(
    cluster: Cluster, host_reference: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Job, str]:
    """A two-node FP8 job in the container, preempted at step 3 (USR1 as Slurm sends it),
    requeued and resumed to the end with the host run's losses. The job and its log."""
    job = submit_two_nodes(cluster, tmp_path_factory.mktemp("ctr-job"), "ctr-preempted", FP8_ARGS)
    return job, preempt_and_check_exact_resume(cluster, job, host_reference)


def container_lines(log: str) -> dict[str, tuple[str, ...]]:
    """srun task -> (hostname, Python version, executable, torch, transformer_engine)."""
    return {m[1]: m.group(2, 3, 4, 5, 6) for m in CONTAINER_LINE.finditer(log)}


def check_ran_in_the_image(log: str) -> None:
    """Both nodes reported from inside the image: its Python, the pinned CPU torch and the
    stand-in's Transformer Engine distribution (the host venv has none), on two hosts; and
    each node's launcher ran on that Python."""
    lines = container_lines(log)
    assert sorted(lines) == ["0", "1"], log
    assert len({host for host, *_ in lines.values()}) == 2, lines
    for _, _, executable, torch, te in lines.values():
        assert executable == "/usr/bin/python" and torch == "2.13.0+cpu", lines
        assert te.startswith("2.") and te.endswith("+double"), lines
    check_both_nodes_ran(log)


@pytest.mark.slow
def test_the_image_is_built_from_the_dockerfile_and_imported(built: tuple[Path, str]) -> None:
    state, script_log = built
    squash = state / "transformer-engine.sqsh"
    assert squash.is_file() and squash.stat().st_size > 500 * 2**20, script_log
    # The Dockerfile's own steps ran on the stand-in (the build succeeded, so its check that the
    # install kept every image-owned package passed), and the TE check found the distribution
    # (and warned, not failed, without flash-attn); a step Docker served from its cache is in
    # the log with what it printed when it ran on the same inputs.
    build_log = (state / "docker-build.log").read_text()
    assert "Successfully installed" in build_log and "transformers-" in build_log, build_log
    assert re.search(
        r"torch 2\.13\.0\+cpu, Transformer Engine 2\.\S+\+double, flash-attn none", build_log
    ), build_log
    assert "warning: no flash-attn in this image" in build_log
    print(script_log)  # the phases and their times (pytest -s)


@pytest.mark.slow
def test_fp8_job_trains_on_two_nodes_inside_the_container(
    cluster: Cluster, preempted_job: tuple[Job, str]
) -> None:
    job, log = preempted_job
    info = cluster.job(job.job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["NumNodes"] == "2" and info["NodeList"] == "node[1-2]", info
    assert f"container: {cluster.env['IMAGE']} (Pyxis)" in log
    assert "precision: torchao float8" in log, log  # FP8 (emulated on CPU)
    losses = seed_losses(log)  # the first launch's steps and the resumed ones
    assert sorted(losses) == list(range(1, STEPS + 1)), log
    assert all(math.isfinite(float(loss)) for loss in losses.values()), losses
    assert float(losses[STEPS]) < float(losses[1]), losses
    assert FINAL_LOSS.search(log), log
    # The Hugging Face cache went to the user's home on the host (mounted), not the image's
    # read-only one.
    assert (Path(cluster.env["HOME"]) / ".cache" / "huggingface").is_dir()


@pytest.mark.slow
def test_preempted_container_job_resumes_exactly_and_computes_what_the_host_does(
    preempted_job: tuple[Job, str],
) -> None:
    """Checkpointed at the step boundary on both nodes (each node's launcher passed the USR1 on
    to its worker: proctrack/pgid), requeued, resumed: every step of both launches has the loss
    of the host venv's uninterrupted run on one node (checked in the fixture), so the image
    computes exactly what the host does, and two nodes what one does. Each launch ran in the
    image on both nodes, with a mesh over the two, and no worker is left behind."""
    job, log = preempted_job
    check_two_node_preemption(log, check_ran_in_the_image)
    for part in log.split("restart 1:", 1):  # the first launch and the requeued one
        ranks = rank_lines(part)
        assert sorted(ranks) == [0, 1], part
        for _, mesh, groups in ranks.values():
            assert mesh == "shard=2" and groups == {"shard": [0, 1]}, part
    assert processes_mentioning(str(job.run_dir)) == []
