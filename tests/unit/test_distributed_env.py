"""The world a rank finds in its environment: torchrun's variables, and Slurm-only ones (srun
without torchrun), also where `scontrol` is missing. The multi-process trainer is tested in
tests/integration/test_distributed.py."""

from __future__ import annotations

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
