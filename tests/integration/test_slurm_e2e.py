"""1.train_llama.sbatch on real Slurm clusters (one node, and two nodes). Without a cluster
(`bash 1.train_llama.sbatch`, and recording stand-ins for srun/scontrol/torchrun):
test_sbatch_without_a_cluster.py.

The real clusters are Debian's slurm-wlm + munge started by tools/slurm_cluster.sh: one node
(this machine), and two nodes, each a slurmd in network and UTS namespaces of its own (its own
address on a bridge and its own hostname; node names resolve nowhere). The two-node cluster
tracks processes by process group (proctrack/pgid), so a signal reaches a worker only if the
launcher passes it on. Those tests need root (slurmd launches job steps; namespaces); without
root, or without Slurm and apt-get to install it, they skip and say why. In CI (CI=true) they
never skip: a missing prerequisite is a failure.

Budget (2 CPU cores): the one-node Slurm job ~0.5 min, the two-node jobs ~1.5 min.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import launch_plan
import pytest
from helpers.procs import processes_mentioning
from helpers.slurm import (
    FINAL_LOSS,
    FINAL_STATES,
    RESUMED,
    SBATCH,
    STEPS,
    Cluster,
    Job,
    check_both_nodes_ran,
    rank_lines,
    seed_losses,
    start_cluster,
    state_is,
    submit,
    submit_two_nodes,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]


# fp32 compute (--bf16=0) on 64-token windows: these jobs test Slurm's path, not a precision or
# a shape; bf16 matmuls run 20-60x slower than fp32 on a CPU without bf16 units, and a 16-step
# worker takes 9.8 CPU s at 64 tokens against 13 at the preset's 256 (benchmarks/results/
# 2026-12-08-make-test.md).
TINY_CPU_ARGS = [
    "--preset",
    "tiny",
    "--max_steps",
    str(STEPS),
    "--warmup",
    "2",
    "--fp8=0",
    "--bf16=0",
    "--train_batch_size",
    "2",
    "--max_context_width",
    "64",
]


# --------------------------------------------------------------------------------------
# A real Slurm cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("slurm-cluster"))


@pytest.fixture(scope="module")
def reference_job(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """One uninterrupted run on one node, two workers: the job a user submits first."""
    job = submit(slurm, tmp_path_factory.mktemp("reference"), "reference", TINY_CPU_ARGS)
    wait_until("the reference job to finish", state_is(slurm, job, *FINAL_STATES), job, slurm)
    return job


@pytest.mark.slow
def test_sbatch_trains_to_completion_on_slurm(slurm: Cluster, reference_job: Job) -> None:
    info, log = slurm.job(reference_job.job_id), reference_job.log()
    assert info["JobState"] == "COMPLETED", log
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", info
    # The script's own directives took effect: requeue allowed, the node held exclusively.
    assert info["Requeue"] == "1" and info["OverSubscribe"] == "NO", info

    assert "host Python" in log and "CPU, 2 workers" in log, log
    losses = seed_losses(log)
    assert sorted(losses) == list(range(1, STEPS + 1)), log
    summary = FINAL_LOSS.search(log)
    assert summary is not None and "Summary" in log, log
    assert float(summary.group(1)) == pytest.approx(float(losses[STEPS]), abs=1e-5)
    assert "requeueing" not in log and "USR1" not in log, "a finished job must not requeue"
    # A late USR1 would not requeue it either: the script reads train.py's last checkpoint.
    assert launch_plan.published.finished(reference_job.run_dir / "checkpoints")


def test_sbatch_directives_are_accepted_by_slurm(slurm: Cluster) -> None:
    result = slurm.run("sbatch", "--test-only", "--nodes=1", str(SBATCH), check=False)
    assert result.returncode == 0, result.stderr
    directives = [
        line.split(None, 1)[1]
        for line in SBATCH.read_text().splitlines()
        if line.startswith("#SBATCH ")
    ]
    for required in ("--ntasks-per-node=1", "--exclusive", "--output=slurm-%j.out", "--requeue"):
        assert required in directives
    signal = next(d for d in directives if d.startswith("--signal="))
    assert re.fullmatch(r"--signal=B:USR1@\d+", signal) and int(signal.split("@")[1]) >= 60


# --------------------------------------------------------------------------------------
# Two nodes: `sbatch --nodes=2`, one CPU worker per node, gloo across the nodes. A preempted
# two-node job (USR1 to the batch shell, each node's launcher passing it on under
# proctrack/pgid, `scontrol requeue`, a resume with the losses of one node's uninterrupted
# run) is test_container_e2e's, inside the image: the same sbatch, launcher and train.py with
# Pyxis between them.


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(
        tmp_path_factory.mktemp("slurm-two-nodes"),
        ("ip", "nsenter", "unshare"),
        SLURM_CLUSTER_NODES="2",
        SLURM_CLUSTER_PROCTRACK="pgid",
    )


def worker_pids(cluster: Cluster, job: Job, node: str) -> list[int]:
    """The training processes (torchrun's workers: they have LOCAL_RANK) of `job` on `node` of
    `cluster`: job ids and node names repeat across the clusters a test session runs at once
    (the container path's two nodes are node1 and node2 too), the configuration file does not."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(
                item.split("=", 1) for item in environ.read_text().split("\0") if "=" in item
            )
        except OSError:
            continue
        where = (env.get("SLURM_CONF"), env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME"))
        if where == (cluster.env["SLURM_CONF"], job.job_id, node):
            if "LOCAL_RANK" in env:
                found.append(int(environ.parent.name))
    return found


HYBRID_ARGS = [*TINY_CPU_ARGS, "--sharding_strategy", "hybrid", "--checkpoint_freq", "4"]
SAVED = re.compile(r"Checkpoint step (\d+) saved to")


@pytest.fixture(scope="module")
def killed_job(two_nodes: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, float]:
    """A hybrid-sharded two-node job whose node-2 worker is killed (kill -9) at step 5, after
    the step-4 checkpoint; returns the job and the seconds from the kill to the job's end."""
    job = submit_two_nodes(two_nodes, tmp_path_factory.mktemp("killed"), "killed", HYBRID_ARGS)
    wait_until("step 5", lambda: "Batch 5 Loss" in job.log(), job, two_nodes)
    [worker] = worker_pids(two_nodes, job, "node2")
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    # An upper bound for a hung test, below the collective timeout that would end it anyway.
    bound = DIST_TIMEOUT_S - 60
    wait_until("the job to end", state_is(two_nodes, job, *FINAL_STATES), job, two_nodes, bound)
    return job, time.monotonic() - killed_at


#: train.py's --dist_timeout default: a survivor left waiting in a collective ends after it.
DIST_TIMEOUT_S = 600


@pytest.mark.slow
def test_a_dead_worker_on_one_node_ends_the_whole_job_not_a_timeout(
    two_nodes: Cluster, killed_job: tuple[Job, float]
) -> None:
    """The survivor's collective fails on the lost connection (torchrun and the launchers end
    the job), not after --dist_timeout: the job ended before the timeout could have ended it,
    and no rank reports a timeout."""
    job, seconds = killed_job
    info, log = two_nodes.job(job.job_id), job.log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    assert info["Restarts"] == "0" and "requeueing" not in log, "a crash is not a preemption"
    assert seconds < DIST_TIMEOUT_S and "Timed out" not in log, (seconds, log[-3000:])
    assert processes_mentioning(str(job.run_dir)) == []  # no worker left on either node


@pytest.mark.slow
def test_the_killed_jobs_last_checkpoint_resumes_with_hybrid_sharding_across_nodes(
    two_nodes: Cluster, killed_job: tuple[Job, float]
) -> None:
    """Resubmitted under the same name: it resumes from the newest checkpoint the killed job
    completed and re-runs the lost steps with the same losses. HSDP: each rank shards within
    its node (alone there) and replicates across the two nodes."""
    killed, _ = killed_job
    before = seed_losses(killed.log())
    last_saved = max(int(step) for step in SAVED.findall(killed.log()))
    shape = [str(REPO / "tools/slurm_cluster.sh"), "shape", str(two_nodes.state_dir), "2"]
    two_nodes.run(*shape, SLOW_LINK)  # node2 sends slowly: the preflight must name its link
    try:
        job = submit_two_nodes(two_nodes, killed.out.parent, "killed", HYBRID_ARGS)
        done = state_is(two_nodes, job, *FINAL_STATES)
        wait_until("the resumed job to finish", done, job, two_nodes)
    finally:
        two_nodes.run(*shape, "off")
    info, log = two_nodes.job(job.job_id), job.log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    resumed = RESUMED.search(log)
    assert resumed and resumed.group(1) == str(
        killed.run_dir / f"checkpoints/step_{last_saved:08d}"
    )
    after = seed_losses(log)
    assert sorted(after) == list(range(last_saved + 1, STEPS + 1)), log
    redone = set(before) & set(after)
    assert redone and {s: after[s] for s in redone} == {s: before[s] for s in redone}

    check_both_nodes_ran(log)
    ranks = rank_lines(log)
    for rank, (_, mesh, groups) in ranks.items():
        assert mesh == "replicate=2 x shard=1", log
        assert groups["shard"] == [rank]  # the rank's node holds only it: whole parameters
        assert groups["replicate"] == [0, 1]
    assert ranks[0][0] != ranks[1][0]  # the replicas sit on different nodes
    slow, fast = f"{ranks[1][0]} -> {ranks[0][0]}", f"{ranks[0][0]} -> {ranks[1][0]}"
    links = json.loads((job.run_dir / "preflight.json").read_text())["links"]
    # A cap, not a timing: the kernel holds node2's sending to 0.025 GB/s, while a veth carried
    # 1.3-2.6 GB/s on this machine idle or loaded (benchmarks/results/2026-12-04-shaped-links.md)
    assert links[slow] < links[fast] / 4, links
    assert f"preflight: slow link {slow}: " in log and f"preflight: slow link {fast}" not in log


#: node2's sending rate in the resumed job: 50x below a veth's, still seconds for the job.
SLOW_LINK = "200mbit"


@pytest.mark.slow
def test_bad_arguments_on_two_nodes_exit_2_once_without_requeue(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    job = submit_two_nodes(two_nodes, tmp_path, "refused", [*TINY_CPU_ARGS, "--lr", "inf"])
    wait_until("the job to end", state_is(two_nodes, job, *FINAL_STATES), job, two_nodes)
    info, log = two_nodes.job(job.job_id), job.log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, log)
    assert log.count("train.py: error: --lr must be a finite number > 0, got inf") == 1, log
    assert info["Restarts"] == "0" and not job.run_dir.exists()
