"""The world a rank finds in its environment: torchrun's variables, and Slurm-only ones (srun
without torchrun), also where `scontrol` is missing. The multi-process trainer is tested in
tests/integration/test_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_utils.parallel import distributed

REPO = Path(__file__).resolve().parents[2]


# ============================================================================================
# Worlds from the environment (no process group)


@pytest.mark.parametrize(
    ("env", "expected", "nodes"),
    [
        ({}, (0, 1, 0, 1), 1),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            (3, 8, 1, 2),
            4,
        ),
        # plain srun, one task per GPU: --ntasks-per-node given, or only the always-set variant
        (
            {
                "SLURM_PROCID": "9",
                "SLURM_NTASKS": "16",
                "SLURM_LOCALID": "1",
                "SLURM_NTASKS_PER_NODE": "8",
            },
            (9, 16, 1, 8),
            2,
        ),
        (
            {
                "SLURM_PROCID": "9",
                "SLURM_NTASKS": "16",
                "SLURM_LOCALID": "1",
                "SLURM_TASKS_PER_NODE": "8(x2)",
            },
            (9, 16, 1, 8),
            2,
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "12",
                "SLURM_LOCALID": "0",
                "SLURM_TASKS_PER_NODE": "8,4",
            },
            (0, 12, 0, 8),
            1,
        ),
        # torchrun inside a Slurm step: torchrun's variables win
        (
            {
                "RANK": "5",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "5",
                "LOCAL_WORLD_SIZE": "8",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
            },
            (5, 16, 5, 8),
            2,
        ),
    ],
)
def test_world_from_env(env: dict[str, str], expected: tuple, nodes: int) -> None:
    world = distributed.world_from_env(env)
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == expected
    assert world.num_nodes == nodes
    assert world.is_main == (expected[0] == 0)


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("gpu-node7", "gpu-node7"),
        ("gpu-a,gpu-b", "gpu-a"),
        ("gpu[1-4]", "gpu1"),  # not 127.0.0.1: the other nodes' ranks would not reach it
        ("gpu-[07,01-04],cpu3", "gpu-07"),
        (None, "127.0.0.1"),
    ],
)
def test_master_addr_without_scontrol(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nodelist: str | None, expected: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    if nodelist is None:
        monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    assert distributed._slurm_master_addr() == expected


# ============================================================================================
# The mesh, as inductor's cache sees it

MESH_HASHES = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from model_utils.parallel import distributed
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torchs = hash(init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)))
ours = distributed.build_mesh(distributed.world_from_env({}), torch.device("cpu"), "full")
print(torchs, hash(ours))
"""


def test_the_runs_mesh_hashes_alike_in_every_process() -> None:
    """Inductor's FX graph cache pickles a mesh's cached hash into its keys (a DTensor's spec
    carries its mesh): with torch's own hash, which differs per process, every process missed
    the cache and compiled torchao's optimizer step anew (3 graphs, ~3 CPU s a process here)."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    hashes = []
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", MESH_HASHES],
            env={**env, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        hashes.append(done.stdout.split())
    (torchs_1, ours_1), (torchs_2, ours_2) = hashes
    assert torchs_1 != torchs_2  # what made the cache miss: not vacuous
    assert ours_1 == ours_2
