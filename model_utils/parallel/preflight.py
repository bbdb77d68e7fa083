"""The preflight: the job's collectives timed on its own nodes and process groups, before step 1.

FSDP2 hides its all-gathers and reduce-scatters under compute only while the links carry the
largest unit in time; a slow link shows much later as a slow step that names nothing. So
before training, each collective FSDP2 runs is timed at that unit's size with the job's backend
(NCCL on GPUs, gloo on CPU): across all ranks, within each node and between nodes, then every
directed link from one node to the next on its own. The bus bandwidths (nccl-tests' measure)
are printed, kept in <output_dir>/preflight.json (analysis.project_scale reads them), and a node
or link at less than half the median of its peers is named.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model_utils.errors import write_whole
from model_utils.parallel.distributed import (
    World,
    all_gather_object,
    fsdp_units,
    run_group_options,
)

#: Payloads on the wire: fp8 travels as its bytes (gloo has no float8; all-gather moves bytes).
PAYLOADS = {"bf16": torch.bfloat16, "fp8": torch.uint8, "fp32": torch.float32}
#: torch's newer names for FSDP2's two collectives, and the older ones (the GPU images' torch).
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
#: A node or link below this share of its peers' median is named.
SLOW = 0.5
RECORD = "preflight.json"


@dataclass(frozen=True)
class Form:
    """What one `--preflight` value times: `auto` is the bounded form multi-node jobs start
    with (seconds); `full` is every payload at the unit's full size."""

    payloads: tuple[str, ...]
    repeats: int
    max_bytes: int


FORMS = {"auto": Form(("bf16",), 2, 64 << 20), "full": Form(tuple(PAYLOADS), 5, 1 << 40)}


def largest_unit(model: nn.Module) -> int:
    """Parameters of the largest FSDP2 unit (a decoder layer, or a vocab-sized matrix): what
    each all-gather and reduce-scatter of a step moves at most. A tied matrix counts once."""
    sizes = [0]
    for unit, _ in fsdp_units(model):
        modules = unit if isinstance(unit, list) else [unit]
        params = {id(p): p for m in modules for p in m.parameters()}  # tied: one matrix
        sizes.append(sum(p.numel() for p in params.values()))
    return max(sizes)


def bus_gbs(nbytes: int, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-gather or reduce-scatter whose full (gathered, or
    to-be-reduced) buffer is `nbytes`: each rank sends and receives (n-1)/n of it."""
    return nbytes * (ranks - 1) / ranks / max(seconds, 1e-9) / 1e9


def _timed(run: Callable[[], Any], device: torch.device, repeats: int, group: Any) -> float:
    """Seconds per call, the slowest rank's (a collective is done when its last rank is)."""
    run()  # warm-up: connections, NCCL's channels
    dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / repeats], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective(op: str, numel: int, dtype: torch.dtype, group: Any, device, repeats: int) -> float:
    """Seconds per `op` ('all_gather' or 'reduce_scatter') of a `numel` buffer over `group`."""
    ranks = dist.get_world_size(group)
    shard = max(1, numel // ranks)
    small = torch.ones(shard, dtype=dtype, device=device)
    full = torch.ones(shard * ranks, dtype=dtype, device=device)
    if op == "all_gather":
        return _timed(lambda: ALL_GATHER(full, small, group=group), device, repeats, group)
    if dtype == torch.uint8:  # --reduce_dtype fp8's wire: one all_to_all of bytes, summed after
        out = torch.empty_like(full)
        return _timed(
            lambda: dist.all_to_all_single(out, full, group=group), device, repeats, group
        )
    return _timed(lambda: REDUCE_SCATTER(small, full, group=group), device, repeats, group)


def scopes(world: World, device: torch.device) -> dict[str, Any]:
    """The process groups to time, named by where their traffic goes (groups of one dropped).
    Its own groups, not a device mesh's (which may share the training mesh's): run() destroys
    them after, so NCCL's communicators for them hold no GPU memory during training."""
    nodes, local = world.num_nodes, world.world_size // world.num_nodes
    if nodes == 1 or local == 1:
        return {"within the node" if nodes == 1 else "across nodes": dist.group.WORLD}
    timeout = run_group_options(device)._timeout  # --dist_timeout, not torch's default
    within, _ = dist.new_subgroups_by_enumeration(
        [list(range(n * local, (n + 1) * local)) for n in range(nodes)], timeout=timeout
    )
    across, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, world.world_size, local)) for i in range(local)], timeout=timeout
    )
    return {"all ranks": dist.group.WORLD, "within each node": within, "across nodes": across}


def link_seconds(world: World, numel: int, device, repeats: int) -> list[float]:
    """Each directed link node i -> node i+1, alone: node i's ranks send to the same local
    rank on the next node while every other rank waits; seconds per send, in node order.
    Batched, so NCCL sends over the world's communicator: a bare send would build a two-rank
    one per pair that holds GPU memory for the rest of the job."""
    local = world.world_size // world.num_nodes
    node = world.rank // local
    buffer = torch.ones(numel, dtype=torch.uint8, device=device)
    seconds = []
    for sender in range(world.num_nodes):
        receiver = (sender + 1) % world.num_nodes
        peer = {sender: (receiver - node) * local, receiver: (sender - node) * local}
        if node not in peer:
            seconds.append(_timed(lambda: None, device, repeats, None))
            continue
        other = world.rank + peer[node]
        op = dist.P2POp(dist.isend if node == sender else dist.irecv, buffer, other)
        seconds.append(
            _timed(lambda o=op: dist.batch_isend_irecv([o])[0].wait(), device, repeats, None)
        )
    return seconds


def slow_ones(values: dict[str, float], what: str) -> list[str]:
    """One line per `values` entry (GB/s) below SLOW of the entries' median, naming it."""
    if len(values) < 2:
        return []
    median = statistics.median(values.values())
    return [
        f"preflight: slow {what} {name}: {gbs:.2f} GB/s, {gbs / median:.2f}x the median "
        f"{what} ({median:.2f} GB/s): check its network (or its GPUs' links) before a long job"
        for name, gbs in values.items()
        if gbs < SLOW * median
    ]


def node_names(world: World) -> list[str]:
    """Each node's host name (its first rank's), numbered where host names repeat."""
    local = world.world_size // world.num_nodes
    hosts = all_gather_object(socket.gethostname())[::local]
    return [h if hosts.count(h) == 1 else f"{h}#{i}" for i, h in enumerate(hosts)]


def run(model: nn.Module, world: World, device: torch.device, form_name: str) -> dict | None:
    """Time the collectives on every rank; the record (rank 0 writes it). None when
    `--preflight` is off, or auto on one node, or there is one rank: nothing crosses a link."""
    if world.world_size == 1 or form_name == "off" or (form_name, world.num_nodes) == ("auto", 1):
        return None
    form, numel, names = FORMS[form_name], largest_unit(model), node_names(world)
    local, groups = world.world_size // world.num_nodes, scopes(world, device)
    rows, within = [], {}
    for payload, (scope, group), op in itertools.product(
        form.payloads, groups.items(), ("all_gather", "reduce_scatter")
    ):
        count = min(numel, form.max_bytes // PAYLOADS[payload].itemsize)
        per_rank = all_gather_object(
            collective(op, count, PAYLOADS[payload], group, device, form.repeats)
        )
        nbytes, ranks = count * PAYLOADS[payload].itemsize, dist.get_world_size(group)
        gbs = [bus_gbs(nbytes, ranks, s) for s in per_rank]
        row = dict(op=op, payload=payload, scope=scope, ranks=ranks, bytes=nbytes)
        rows.append(row | {"seconds": max(per_rank), "bus_gbs": min(gbs)})  # the slowest group
        if scope == "within each node" and not within:
            within = dict(zip(names, gbs[::local], strict=True))
    for group in groups.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    links: dict[str, float] = {}
    if world.num_nodes > 1:
        nbytes = min(numel * 2, form.max_bytes)
        seconds = link_seconds(world, nbytes, device, form.repeats)
        links = {
            f"{a} -> {b}": nbytes / s / 1e9
            for a, b, s in zip(names, names[1:] + names[:1], seconds, strict=True)
        }
    slow = slow_ones(links, "link") + slow_ones(within, "node")
    kind = dict(form=form_name, backend=dist.get_backend(), nodes=world.num_nodes)
    return kind | dict(
        ranks=world.world_size,
        unit_parameters=numel,
        collectives=rows,
        links=links,
        within_nodes=within,
        slow=slow,
    )


def summary(record: dict) -> list[str]:
    """The lines a person reads: one per payload and collective, then the slow ones."""
    lines = [
        f"preflight ({record['form']}, {record['backend']}, {record['nodes']} node(s), "
        f"{record['ranks']} ranks): largest FSDP unit {record['unit_parameters']:,} parameters; "
        f"bus bandwidth in GB/s; all in {RECORD}"
    ]
    for row in record["collectives"]:
        lines.append(
            f"preflight: {row['op'].replace('_', '-')} {row['payload']} "
            f"{row['bytes'] / 2**20:.1f} MiB {row['scope']} ({row['ranks']} ranks): "
            f"{row['bus_gbs']:.2f} GB/s, {row['seconds'] * 1e3:.2f} ms"
        )
    if record["links"]:
        lines.append(
            "preflight: links per GPU pair (a node's GPUs each to its peer on the next, at "
            "once) " + ", ".join(f"{k} {v:.2f}" for k, v in record["links"].items())
        )
    return lines + record["slow"]


def check(model: nn.Module, world: World, device: torch.device, config) -> None:
    """`--preflight` of a run's config: run on every rank; rank 0 keeps the record in the run's
    folder and logs it, slow ones as warnings."""
    record, log = run(model, world, device, config.parallel.preflight), logging.getLogger("train")
    if config.parallel.preflight == "full" and world.world_size == 1:  # asked for, said why not
        log.info("preflight: a world of one has no collective to time")
    if record is None or not world.is_main:
        return
    write_whole(Path(config.run.output_dir) / RECORD, json.dumps(record, indent=1))
    for line in summary(record):
        (log.warning if line.startswith("preflight: slow") else log.info)("%s", line)
