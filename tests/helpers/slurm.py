"""Real Slurm clusters for the end-to-end tests (tools/slurm_cluster.sh: one node, or two in
network namespaces of their own), jobs submitted as a user submits them, and the checks the
one-node, two-node and container tests share: the seed-format losses, an exact resume after a
preemption, both nodes' start-up lines."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "1.train_llama.sbatch"
CLUSTER = REPO / "tools" / "slurm_cluster.sh"
INSTALL_DEPS = REPO / "tools" / "install_test_deps.sh"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The seed recipe's log line, e.g. "Batch 20 Loss: 8.42184, Speed: 47.06 samples/sec, lr: 0.000100"
SEED_LINE = re.compile(
    r"Batch (\d+) Loss: (\d+\.\d{5}), Speed: (\d+\.\d{2}) samples/sec, lr: (\d+\.\d{6})"
)
PREEMPTED = re.compile(r"Preemption signal received: checkpoint saved at step (\d+)")
RESUMED = re.compile(r"Resumed from (\S+) at step (\d+)")
FINAL_LOSS = re.compile(r"final train loss\s+(\d+\.\d+)")

# The jobs' --max_steps (test_slurm_e2e's and test_container_e2e's): long enough to signal
# mid-run, short enough for the budget.
STEPS = 16


def skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI must run the Slurm tests)")
    pytest.skip(reason)


#: The suite's thread counts (tests/conftest.py TEST_THREADS): a job's launcher sets its own.
SUITE_THREADS = ("OMP_NUM_THREADS", "RAYON_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any SLURM_* variable (pytest may itself run inside a
    Slurm job) or the suite's thread counts (the launcher divides the cores among a node's
    workers, as for a user), plus `extra`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SUITE_THREADS
    }
    env.update(extra)
    return env


def seed_losses(log: str) -> dict[int, str]:
    """Step -> loss text (5 decimals, as printed) of every seed-format line in `log`."""
    return {int(m.group(1)): m.group(2) for m in SEED_LINE.finditer(log)}


# --------------------------------------------------------------------------------------
# A real Slurm cluster and its jobs


@dataclass
class Cluster:
    state_dir: Path
    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.state_dir / "log").glob("slurm*.log")):
            tail = "\n".join(path.read_text().splitlines()[-30:])
            parts.append(f"--- {path.name} (tail)\n{tail}")
        return "\n".join(parts)


def start_cluster(state: Path, tools: tuple[str, ...] = (), **settings: str) -> Iterator[Cluster]:
    """tools/slurm_cluster.sh start/stop around the tests, with SLURM_CLUSTER_* settings."""
    if os.geteuid() != 0:
        skip_or_fail("needs root: slurmd must run as root to start job steps")
    needed = ("slurmctld", "slurmd", "munged", "sbatch", *tools)
    if not all(shutil.which(t) for t in needed):
        if shutil.which("apt-get") is None:
            skip_or_fail(f"one of {needed} is missing and there is no apt-get to install it")
        subprocess.run([str(INSTALL_DEPS)], check=True, timeout=600)
    started = subprocess.run(
        [str(CLUSTER), "start", str(state)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **settings},
    )
    cluster = Cluster(state, clean_env(SLURM_CONF=str(state / "slurm.conf")))
    if started.returncode != 0:
        subprocess.run([str(CLUSTER), "stop", str(state)], timeout=60)
        pytest.fail(f"the Slurm cluster did not start:\n{started.stderr}\n{cluster.logs()}")
    try:
        yield cluster
    finally:
        subprocess.run([str(CLUSTER), "stop", str(state)], timeout=60)


@dataclass
class Job:
    job_id: str
    out: Path
    run_dir: Path

    def log(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def submit(
    cluster: Cluster,
    tmp: Path,
    name: str,
    args: list[str],
    nodes: int = 1,
    workers: int = 2,
    **env: str,
) -> Job:
    """sbatch exactly as a user would (from the repo, the script's own directives), on `nodes`
    nodes with `workers` CPU workers each; output and run folders go to `tmp`."""
    env = {"RUN_NAME": name, **env}  # the folder is the job's name (no precision appended)
    env = dict(cluster.env, NPROC_PER_NODE=str(workers), RUNS_DIR=str(tmp / "runs"), **env)
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            f"--job-name={name}",
            f"--output={tmp}/slurm-%j.out",
            str(SBATCH),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    job_id = out.strip().split(";")[0]
    return Job(job_id, tmp / f"slurm-{job_id}.out", tmp / "runs" / name)


def wait_until(
    what: str, done: Callable[[], bool], job: Job, cluster: Cluster, timeout: float = 300
) -> None:
    """Poll `done` until true; on timeout fail with everything needed to see why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.5)
    pytest.fail(
        f"timed out after {timeout}s waiting for {what}\njob: {cluster.job(job.job_id)}\n"
        f"--- job output\n{job.log()}\n{cluster.logs()}"
    )


def state_is(cluster: Cluster, job: Job, *states: str) -> Callable[[], bool]:
    return lambda: cluster.job(job.job_id).get("JobState") in states


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def preempt_and_check_exact_resume(cluster: Cluster, job: Job, reference_log: str) -> str:
    """USR1 at step 3 as Slurm sends it before the time limit; the job must checkpoint,
    requeue itself, resume and end with the losses of the uninterrupted run that printed
    `reference_log`, step for step. Its log."""
    reference = seed_losses(reference_log)
    assert sorted(reference) == list(range(1, STEPS + 1)), reference_log
    wait_until("step 3", lambda: "Batch 3 Loss" in job.log(), job, cluster)
    # What Slurm does `--signal=B:USR1@300` before the time limit: USR1 to the batch shell.
    cluster.run("scancel", "--batch", "--signal=USR1", job.job_id)

    # The requeued job waits cred_expire (5 s on the test cluster, 120 s by default) and
    # then starts again on its own.
    wait_until("the requeued job to finish", state_is(cluster, job, *FINAL_STATES), job, cluster)

    info, log = cluster.job(job.job_id), job.log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "1", info
    preempted, resumed = PREEMPTED.search(log), RESUMED.search(log)
    assert preempted and resumed, log
    saved_step = int(preempted.group(1))
    assert 3 <= saved_step < STEPS, log
    assert int(resumed.group(2)) == saved_step, log
    assert Path(resumed.group(1)).is_relative_to(job.run_dir / "checkpoints"), log
    assert "requeueing job" in log and "restart 1:" in log, log

    # After the resume: exactly the remaining steps, each with the uninterrupted run's loss.
    after = seed_losses(log[resumed.end() :])
    assert sorted(after) == list(range(saved_step + 1, STEPS + 1)), log
    assert after == {step: reference[step] for step in after}
    before = seed_losses(log[: preempted.start()])
    assert before == {step: reference[step] for step in before}
    final = FINAL_LOSS.findall(log)
    assert final and final[-1] == FINAL_LOSS.search(reference_log).group(1)
    return log


# --------------------------------------------------------------------------------------
# Two nodes: `sbatch --nodes=2`, one CPU worker per node, gloo across the nodes

IPV4 = r"\d+\.\d+\.\d+\.\d+"
# "0: [node node1 ip-10-1-2-11 10.1.2.11] CPU, 1 workers, ..." (srun --label: task 0 = node 0)
NODE_LINE = re.compile(rf"^(\d+): \[node (\S+) (\S+) ({IPV4})\] CPU, 1 workers", re.M)
# "1: rank 1/2 on ip-10-1-2-12: mesh replicate=2 x shard=1, replicate group [0, 1], ..."
RANK_LINE = re.compile(r"^\d+: rank (\d+)/2 on (\S+): mesh (\S+(?: x \S+)*), (.*)$", re.M)
GROUP = re.compile(r"(\w+) group \[([\d, ]*)\]")


def node_lines(log: str) -> dict[str, tuple[str, str, str]]:
    """srun task label -> (node name, hostname, address) from each node's launcher line."""
    return {m.group(1): m.group(2, 3, 4) for m in NODE_LINE.finditer(log)}


def rank_lines(log: str) -> dict[int, tuple[str, str, dict[str, list[int]]]]:
    """rank -> (hostname, mesh, {dim: group ranks}) from each rank's start-up line."""
    ranks = {}
    for m in RANK_LINE.finditer(log):
        groups = {
            name: [int(r) for r in members.split(",")] for name, members in GROUP.findall(m[4])
        }
        ranks[int(m[1])] = (m[2], m[3], groups)
    return ranks


def submit_two_nodes(cluster: Cluster, tmp: Path, name: str, args: list[str]) -> Job:
    """One worker per node, with one thread as each of the one-node reference's two workers
    has (both "nodes" share this machine's cores): CPU kernels sum in another order with
    another thread count, and the losses are compared bit for bit."""
    return submit(cluster, tmp, name, args, nodes=2, workers=1, OMP_NUM_THREADS="1")


def check_both_nodes_ran(log: str) -> None:
    """Each node's launcher and each rank logged, on two hosts with addresses of their own;
    torchrun met at the first node's address, not at a node name (which resolves nowhere)."""
    nodes = node_lines(log)
    assert set(nodes) == {"0", "1"} and nodes["0"][0] == "node1", log
    assert len({host for _, host, _ in nodes.values()}) == 2, nodes
    assert re.search(rf"rendezvous {nodes['0'][2]}:\d+ \(node1\)", log), log
    ranks = rank_lines(log)
    assert sorted(ranks) == [0, 1], log
    assert {host for host, _, _ in ranks.values()} == {host for _, host, _ in nodes.values()}
    assert "world: 2 ranks (2 nodes)" in log
    assert "preflight (auto, gloo, 2 node(s), 2 ranks)" in log  # multi-node: always, bounded


def check_two_node_preemption(log: str, check_part: Callable[[str], None]) -> None:
    """A preempted two-node job's log: the first run and the requeued one each pass
    `check_part` (ran on both nodes, or in the image), and each node's launcher received the
    USR1 in the first (each passes it on to its own workers)."""
    first, second = log.split("restart 1:", 1)
    for part in (first, second):
        check_part(part)
    for rank in (0, 1):
        assert re.search(rf"^{rank}: \[node \S+\] SIGUSR1 received", first, re.M), first
