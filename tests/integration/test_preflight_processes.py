"""The preflight on real gloo process groups: four ranks laid out as two nodes of two, so every
scope (all ranks, within each node, across nodes) and every directed link is timed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.inprocess import tiny_llama
from helpers.procs import rank_env, spawn_ranks

from model_utils.parallel import preflight
from model_utils.parallel.distributed import World


def _two_nodes_of_two(rank: int, world_size: int, port: int, out: str, form: str) -> None:
    """The preflight, then the timeouts of HSDP's mesh groups and the preflight's own groups
    (rank 0 writes both) in a world started with a 77 s timeout."""
    from datetime import timedelta

    import torch

    from model_utils.parallel.distributed import build_mesh

    os.environ.update(rank_env(rank, world_size, port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=77))
    world, cpu = World(rank, world_size, rank % 2, 2), torch.device("cpu")
    record = preflight.run(tiny_llama(), world, cpu, form)
    mesh = build_mesh(world, cpu, "hybrid")
    groups = {name: mesh.get_group(name) for name in ("replicate", "shard")}
    groups |= preflight.scopes(world, cpu)
    seconds = {n: g._get_backend(cpu).options._timeout.total_seconds() for n, g in groups.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(record))
        Path(f"{out}.timeouts").write_text(json.dumps(seconds))
    dist.barrier()


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("preflight") / "record.json"
    spawn_ranks(_two_nodes_of_two, 4, str(out), "full")
    return out


def test_full_preflight_times_every_scope_payload_and_link(full):
    record = json.loads(full.read_text())
    layer = sum(p.numel() for p in tiny_llama().model.layers[0].parameters())
    assert record["unit_parameters"] == layer > 256 * 64  # a decoder layer, not the embedding
    rows = {(r["op"], r["payload"], r["scope"]): r for r in record["collectives"]}
    scopes = {"all ranks": 4, "within each node": 2, "across nodes": 2}
    for op in ("all_gather", "reduce_scatter"):
        for payload, dtype in preflight.PAYLOADS.items():
            for scope, ranks in scopes.items():
                row = rows[(op, payload, scope)]
                assert row["ranks"] == ranks
                assert row["bytes"] == layer * dtype.itemsize
                assert row["bus_gbs"] == preflight.bus_gbs(row["bytes"], ranks, row["seconds"]) > 0
    assert len(record["links"]) == 2 and all(v > 0 for v in record["links"].values())
    assert len(record["within_nodes"]) == 2
    lines = preflight.summary(record)
    assert lines[0].startswith("preflight (full, gloo, 2 node(s), 4 ranks)")
    assert len(lines) == 1 + len(rows) + 1 + len(record["slow"])


def test_the_mesh_and_preflight_groups_keep_the_runs_timeout(full):
    """--dist_timeout (the default group's) reaches the groups split from it: torch would give
    them its own default (30 minutes on gloo, 10 on NCCL), so a hang in HSDP's replicate or
    shard group, or in the preflight's, would outlast the run's timeout."""
    seconds = json.loads(Path(f"{full}.timeouts").read_text())
    assert set(seconds) == {"replicate", "shard", "all ranks", "within each node", "across nodes"}
    assert set(seconds.values()) == {77.0}, seconds


def test_auto_preflight_skips_one_node(tmp_path, caplog):
    from model_utils.config.arguments import parse_args

    out = tmp_path / "record.json"
    world = World(0, 1, 0, 1)
    assert preflight.run(tiny_llama(), world, None, "full") is None  # nothing crosses a link
    config = parse_args(["--preset=tiny", "--preflight=full", f"--output_dir={tmp_path / 'run'}"])
    with caplog.at_level("INFO", logger="train"):
        preflight.check(tiny_llama(), world, None, config)  # asked for: says why it times nothing
    assert caplog.messages == ["preflight: a world of one has no collective to time"]
    assert not (tmp_path / "run").exists()
    spawn_ranks(_two_nodes_of_two, 4, str(out), "auto")
    record = json.loads(out.read_text())
    assert {r["payload"] for r in record["collectives"]} == {"bf16"}  # the bounded form
