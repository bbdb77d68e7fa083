"""The test helpers that start ranks: a rank that fails must still fail the test, and one that
succeeds exits without interpreter shutdown (the moment a gloo thread could abort it); each
pytest-xdist worker picks rendezvous ports from its own block."""

from __future__ import annotations

import atexit
import os
import socket

import pytest
import torch.distributed as dist
from helpers.procs import free_port, spawn_ranks, worker_ports
from torch.multiprocessing.spawn import ProcessRaisedException


def _barrier_then_return(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    marker = os.path.join(out_dir, f"atexit_{rank}")
    # Runs only if the interpreter shuts down; the helper's exit skips that on purpose.
    atexit.register(lambda: open(marker, "w").close())
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"done_{rank}"), "w") as done:
        done.write("ok")


def _raise_on_rank_one(rank: int, world: int, port: int, out_dir: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")


def test_a_finished_rank_skips_interpreter_shutdown(tmp_path) -> None:
    spawn_ranks(_barrier_then_return, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done_0", "done_1"]


def test_a_rank_that_raises_fails_the_call(tmp_path) -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1 broke on purpose"):
        spawn_ranks(_raise_on_rank_one, 2, str(tmp_path))


def test_each_xdist_worker_takes_free_ports_from_its_own_block(monkeypatch) -> None:
    blocks = {}
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks[worker] = set(worker_ports())
        port = free_port()
        assert port in blocks[worker]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
    assert len(set.union(*blocks.values())) == 4 * 2000  # disjoint
    assert max(set.union(*blocks.values())) < 29500  # below the ephemeral range and Slurm's ports
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    assert set(worker_ports()) == blocks["gw1"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"no free port in \\[{busy}, {busy}\\]"):
            free_port(busy, busy + 1)  # a port someone listens on is never handed out
