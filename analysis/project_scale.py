"""What FP8 buys on N nodes, projected from a pair measured at a smaller scale (one GPU here).

    .venv/bin/python -m analysis.project_scale runs/1b-bf16 runs/1b-fp8 --nodes 1,2,4,16

FSDP2 moves each unit's parameters in (all-gather, forward and again in backward when it was
resharded) and its gradients out (reduce-scatter) once a step. On a ring of n GPUs a collective
of S bytes takes S (n - 1) / n / B, B the per-GPU bus bandwidth: the node's links within a node
(NVLink), the network's per GPU across nodes. A unit's collective hides under the compute of the
unit beside it, so what is left exposed is each gather or reduce longer than that compute, and
the ones nothing runs beside: the first gathers of the forward (the embedding is a lookup, no
compute) and the last reduces of the backward. Hybrid sharding shards within a node and adds an
all-reduce of a node's gradient shard across nodes. Step time = the measured step (all compute,
its collectives taken as hidden at the measured scale, or as exposed as the run's profiler traces
show them, when it has any) + exposed time at the target scale. The
bandwidths are given, or a job's preflight measured them (`--preflight FILE`): then the
reduce-scatter runs at its own measured share of the all-gather's, and on gloo (CPU ranks wait
on each collective) nothing hides.

Not modelled: collective latency (it grows with the ring), stragglers, NCCL's tree and NVLS
algorithms, pipeline and tensor parallelism. REFERENCES holds published multi-node runs with
their sources; tests/unit/test_project_scale.py holds the projection to them (docs/cluster.md,
"Before you scale").
"""

from __future__ import annotations

import io
import json
import math
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "environment_check.py"))
from analysis import compare_runs, step_breakdown
from model_utils.config.sections import ModelShape
from model_utils.errors import OneLineParser, os_error_words, write_whole
from model_utils.parallel.fp8_reduce import BLOCK
from model_utils.report import metrics
from model_utils.report.metrics.flops import matmul_params
from model_utils.report.metrics.records import first_run_record

#: H100/H200 bus bandwidth of an NCCL all-gather inside an 8-GPU NVLink node, and a 400 Gb/s
#: network port per GPU (InfiniBand or RoCE, the usual H100 cluster): GB/s.
NVLINK_GBS = 360.0
NETWORK_GBS = 50.0
#: How close the projection comes to each published figure (REFERENCES; the worst is 2.0%).
TOLERANCE = 0.03
#: Bytes a gradient element moves by --reduce_dtype in the shard's reduce-scatter (fp8: parallel/
#: fp8_reduce.py's value and block scale) and in hybrid's all-reduce across nodes (FSDP2's, fp32).
REDUCE_BYTES = {"fp32": (4.0, 4.0), "bf16": (2.0, 2.0), "fp8": (1 + 4 / BLOCK, 4.0)}


@dataclass(frozen=True)
class Job:
    """What a step moves and computes: parameters of the first unit (the embedding table), of
    each decoder layer, the tokens a GPU trains a step, and its tokens/s at the measured scale."""

    embedding: float
    layer: float
    layers: int
    tokens_per_gpu: int
    tokens_per_sec: float
    gather_bytes: float = 2.0  # bf16; a float8 all-gather moves the layers' weights in 1 byte
    reduce: str = "fp32"  # --reduce_dtype: a key of REDUCE_BYTES
    param_bytes: float = 2.0  # what the embedding's gather moves: float8 gathers only Linears
    #: The share of the measured step its collectives left exposed, where profiler traces said
    #: it (the slowest rank's); else the model's own estimate at the measured scale.
    exposed_share: float | None = None
    #: The shares of the step the forward and the backward computed, where traces said them;
    #: else a third and two thirds (a backward's two GEMMs per forward GEMM).
    compute_shares: tuple[float, float] = (1 / 3, 2 / 3)

    @property
    def step_seconds(self) -> float:
        return self.tokens_per_gpu / self.tokens_per_sec

    def layer_seconds(self) -> tuple[float, float]:
        """A decoder layer's forward and backward compute: what hides its collectives."""
        return tuple(self.step_seconds * share / self.layers for share in self.compute_shares)


def ring(nbytes: float, gpus: int, gbs: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of `nbytes` over `gpus` GPUs."""
    return 0.0 if gpus < 2 else nbytes * (gpus - 1) / gpus / (gbs * 1e9)


def _positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@dataclass(frozen=True)
class Links:
    """Bus bandwidths in GB/s: within a node, and across nodes per GPU; a reduce-scatter's
    share of the all-gather's (gloo reduces by an all-reduce: about half); whether a collective
    runs beside compute (NCCL on its own stream) or in its way (gloo: CPU ranks wait on it)."""

    node: float = NVLINK_GBS
    network: float = NETWORK_GBS
    reduce_share: float = 1.0
    overlap: bool = True
    measured: tuple[str, ...] = field(default=(), compare=False)  # by a preflight: node, network


def links_of(record: dict, given: Links = Links()) -> Links:
    """The bus bandwidths a preflight measured (its <output_dir>/preflight.json): its first
    payload's all-gather (bf16) within a node and across nodes; what it did not measure (one
    node: no network) stays `given`."""
    found, reduced = {}, {}
    for row in record["collectives"]:
        if row["scope"] != "all ranks":
            where = "network" if row["scope"] == "across nodes" else "node"
            (found if row["op"] == "all_gather" else reduced).setdefault(where, row["bus_gbs"])
    share = {k: reduced[k] / found[k] for k in found if k in reduced}
    found["reduce_share"] = share.get("network", share.get("node", given.reduce_share))
    measured = tuple(k for k in ("node", "network") if k in found)
    return replace(given, **found, overlap=record["backend"] != "gloo", measured=measured)


def links_line(links: Links, preflight: str | None) -> str:
    """The bandwidths the table used and where each came from: a one-node preflight measures
    no network, and the default it keeps made more nodes project faster than one."""

    def source(name: str, flag: str, default: float) -> str:
        if name in links.measured:
            return f"measured: {preflight}"
        return f"given: {flag}" if getattr(links, name) != default else f"assumed: {flag}'s default"

    node = source("node", "--node_gbs", NVLINK_GBS)
    network = source("network", "--network_gbs", NETWORK_GBS)
    return (
        f"links: {links.node:g} GB/s in a node ({node}), {links.network:g} GB/s per GPU across "
        f"nodes ({network})"
    )


def exposed_seconds(
    job: Job, nodes: int, gpus_per_node: int, hybrid: bool = False, links: Links = Links()
) -> float:
    """The collectives of one step that nothing hides, at `nodes` x `gpus_per_node`."""
    shard = gpus_per_node if hybrid else nodes * gpus_per_node
    gbs = links.node if nodes == 1 or hybrid else links.network

    def reduce(params: float) -> float:  # the shard's reduce, then hybrid's all-reduce across
        scatter, all_reduce = REDUCE_BYTES[job.reduce]
        inside = ring(params * scatter, shard, gbs * links.reduce_share)
        across = 2 * ring(params * all_reduce / gpus_per_node, nodes, links.network)
        return inside + (across if hybrid else 0.0)

    gather = ring(job.layer * job.gather_bytes, shard, gbs)
    # a layer's forward and backward compute hide its collectives, if anything can
    forward, backward = job.layer_seconds() if links.overlap else (0.0, 0.0)
    edges = ring(job.embedding * job.param_bytes, shard, gbs) + gather
    edges += reduce(job.layer) + reduce(job.embedding)
    per_layer = max(0.0, gather - forward) + max(0.0, gather + reduce(job.layer) - backward)
    return edges + job.layers * per_layer


def projected(
    job: Job, base: tuple[int, int], nodes: int, gpus_per_node: int, base_links=None, **how
) -> float:
    """Tokens/s per GPU at `nodes` x `gpus_per_node`, from `job` measured at `base` (nodes,
    GPUs per node, over `base_links`, else the target's): the measured step less its own
    exposed time, plus the target's."""
    at_base = how if base_links is None else {**how, "links": base_links}
    compute = job.step_seconds - exposed_seconds(job, *base, **at_base)
    if job.exposed_share is not None:
        compute = job.step_seconds * (1 - job.exposed_share)
    return job.tokens_per_gpu / (compute + exposed_seconds(job, nodes, gpus_per_node, **how))


@dataclass(frozen=True)
class Reference:
    """A published multi-node figure: tokens/s per GPU at two scales of one job."""

    name: str
    source: str
    job: Job
    base: tuple[int, int]
    at: tuple[int, int]
    published: float


#: Llama 3.1 8B (32 layers of 218M parameters, a 525M-parameter embedding), 2 x 8192 tokens a GPU.
_8B = dict(embedding=525e6, layer=218e6, layers=32, tokens_per_gpu=16384)
REFERENCES = (
    Reference(
        "torchtitan Llama 3.1 8B, H100, BF16, 8 -> 128 GPUs",
        "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
        Job(**_8B, tokens_per_sec=6667),
        (1, 8),
        (16, 8),
        6514,
    ),
    Reference(
        "torchtitan Llama 3.1 8B, H100, float8 + FP8 all-gather, 8 -> 128 GPUs",
        "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
        Job(**_8B, tokens_per_sec=8532, gather_bytes=1.0),
        (1, 8),
        (16, 8),
        8380,
    ),
    Reference(
        "Trainy Llama 3 8B, H200, 400 Gb/s a GPU, float8 + FP8 all-gather, 32 -> 64 GPUs",
        "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md",
        Job(**_8B, tokens_per_sec=10938, gather_bytes=1.0),
        (4, 8),
        (8, 8),
        10753,
    ),
)


def job_of(run: str) -> Job:
    """A measured run folder as a Job: its shape, batch and median tokens/s after warm-up."""
    found = compare_runs.load_run(f"{run}/metrics.jsonl")  # as compare_runs reads it
    if found.info is None:
        raise ValueError(f"{run}/metrics.jsonl holds no run record: give a train.py run folder")
    flags = found.info["flags"]
    shape = ModelShape(**{f.name: flags[f.name] for f in fields(ModelShape) if f.name in flags})
    table = shape.hidden_width * shape.vocab_size
    layer = (matmul_params(shape) - table) / shape.num_layers
    records = [r for r in found.records if r["kind"] == "train"]
    speed = metrics.summarize(records, 5).get("tokens_per_sec_per_device")
    if not speed:
        raise ValueError(f"{run} logged no tokens/s after step 5")
    tokens = flags["train_batch_size"] * flags["max_context_width"] * flags["grad_accum_steps"]
    embedding = table if shape.tie_word_embeddings else 2 * table  # and the untied lm_head
    param = 2.0 if flags.get("bf16", True) else 4.0
    gather = 1.0 if flags.get("fp8_all_gather") else param
    job = Job(embedding, layer, shape.num_layers, tokens, speed, gather, param_bytes=param)
    return replace(job, reduce=flags.get("reduce_dtype", "fp32"), **traced_shares(run))


#: What in a profiled step is neither the forward's compute nor the backward's.
NOT_LAYERS = ("comm_exposed", "optimizer", "data_wait", "idle")


def traced_shares(run: str) -> dict:
    """From a profiled run's newest trace window (``--profile_steps``), its slowest rank's
    shares of the step: exposed by collectives, computed by the forward (its range: the
    embedding and lm_head's too) and by the rest (the backward); {} for a run without traces."""
    try:
        slowest = step_breakdown.read_run(Path(run), None).slowest
    except step_breakdown.Refused as exc:
        if exc.__cause__:  # a trace there but damaged: refused, not taken for no trace
            raise
        return {}
    total, ms, forward = slowest.total_ms, slowest.ms, slowest.forward_ms
    backward = total - forward - sum(ms.get(k, 0.0) for k in NOT_LAYERS)
    return dict(
        exposed_share=ms["comm_exposed"] / total, compute_shares=(forward / total, backward / total)
    )


def scales(bf16: Job, fp8: Job, nodes: Sequence[int], gpus_per_node: int, links: Links) -> list:
    """(nodes, hybrid, {arm: (tokens/s per GPU, exposed seconds a step)}) at each scale, full
    and hybrid sharding, for BF16, FP8 and FP8 with the float8 all-gather."""
    arms = {"bf16": bf16, "fp8": fp8, "fp8+ag": replace(fp8, gather_bytes=1.0)}
    found = []
    for n, hybrid in [(k, h) for k in nodes for h in ((False, True) if k > 1 else (False,))]:
        how = dict(hybrid=hybrid, links=links)
        found.append(
            (
                n,
                hybrid,
                {
                    arm: (
                        projected(job, (1, 1), n, gpus_per_node, **how),
                        exposed_seconds(job, n, gpus_per_node, **how),
                    )
                    for arm, job in arms.items()
                },
            )
        )
    return found


def table(found: list, gpus_per_node: int) -> str:
    """Tokens/s per GPU, FP8's ratios and the communication left exposed, per scale."""
    head = f"{'nodes x GPUs':14s}{'sharding':10s}{'bf16':>9s}{'fp8':>9s}{'ratio':>7s}"
    lines = [head + f"{'fp8+ag':>9s}{'ratio':>7s}  exposed ms: bf16 fp8+ag (projected per GPU)"]
    for n, hybrid, arm in found:
        (b, eb), (f, _), (a, ea) = arm.values()
        where, sharding = f"{n} x {gpus_per_node}", "hybrid" if hybrid else "full"
        lines.append(
            f"{where:14s}{sharding:10s}{b:9,.0f}{f:9,.0f}{f / b:7.3f}{a:9,.0f}"
            f"{a / b:7.3f}{eb * 1e3:17.1f}{ea * 1e3:7.1f}"
        )
    return "\n".join(lines)


def picture(found: list, path: str) -> None:
    """FP8's projected ratio (left) and the exposed communication (right) against nodes; full
    sharding solid, hybrid dashed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    ratio, exposed = figure.subplots(1, 2)
    colors = {"bf16": "C0", "fp8": "C1", "fp8+ag": "C2"}  # an arm's colour in both styles
    for hybrid, style in ((False, "-"), (True, "--")):
        rows = [(n, arm) for n, h, arm in found if h == hybrid or n == 1]
        nodes, how = [n for n, _ in rows], dict(linestyle=style)
        for name in ("fp8", "fp8+ag"):
            label, how["color"] = f"{name} {'hybrid' if hybrid else 'full'}", colors[name]
            ratio.plot(nodes, [a[name][0] / a["bf16"][0] for _, a in rows], label=label, **how)
        for name in ("bf16", "fp8", "fp8+ag"):
            label, how["color"] = f"{name} {'hybrid' if hybrid else 'full'}", colors[name]
            exposed.plot(nodes, [a[name][1] * 1e3 for _, a in rows], label=label, **how)
    for axes, what in ((ratio, "FP8 / BF16 tokens/s per GPU"), (exposed, "exposed ms a step")):
        axes.set(xscale="log", xlabel="nodes (hybrid dashed)", ylabel=what, title="projected")
        axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    write_whole(Path(path), buffer.getvalue())


def check_pair(runs: Sequence[str]) -> None:
    """Refused: a pair in the wrong order (BF16 first), of other models or batches, or not
    measured on one GPU (a larger world's step holds collectives projected again on top)."""
    records = [first_run_record(f"{run}/metrics.jsonl") or {} for run in runs]
    for run, record in zip(runs, records, strict=True):
        if record.get("world_size", 1) != 1:
            raise ValueError(
                f"{run} trained on {record['world_size']} ranks: project a pair measured on one GPU"
            )
    flags = [record.get("flags") or {} for record in records]
    if [bool(f.get("fp8")) for f in flags] != [False, True]:
        raise ValueError(f"give the BF16 run first, then its FP8 twin: got {' and '.join(runs)}")
    unlike = step_breakdown.unlike_flags(*flags)
    if unlike:
        raise ValueError(
            f"{runs[1]} is not like {runs[0]}: {', '.join(unlike)} (only --fp8 may differ)"
        )


def preflight_links(path: str, given: Links, parser: OneLineParser) -> Links:
    """The links a preflight.json measured (the rest `given`), or the parser's one-line error."""
    try:
        record = json.loads(Path(path).read_text())
        links = links_of(record if isinstance(record, dict) else {}, given)
        if not _positive(links.node, links.network, links.reduce_share):
            raise ValueError(f"bandwidths {links.node}, {links.network} GB/s")
        return links
    except OSError as exc:
        parser.error(f"--preflight {path}: cannot be read ({os_error_words(exc)})")
    except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
        why = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc)
        parser.error(f"--preflight {path}: not a run's preflight.json ({why})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="project_scale.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("bf16", help="the BF16 run folder of a pair measured on one GPU")
    parser.add_argument("fp8", help="its FP8 twin")
    parser.add_argument("--nodes", default="1,2,4,16", help="node counts to project to")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--node_gbs", type=float, help=f"bus GB/s in a node ({NVLINK_GBS:g})")
    parser.add_argument("--network_gbs", type=float, help=f"GB/s per GPU ({NETWORK_GBS:g})")
    parser.add_argument(
        "--preflight", metavar="FILE", help="a job's preflight.json: its measured bandwidths"
    )
    parser.add_argument("--output", metavar="PNG", help="the projection as a picture too")
    parser.add_argument(
        "--reduce_dtype", choices=REDUCE_BYTES, help="the gradients' (default: the pair's own)"
    )
    args = parser.parse_args(argv)
    runs = [run.removesuffix("/metrics.jsonl") for run in (args.bf16, args.fp8)]  # its folder
    gbs = {"node": args.node_gbs, "network": args.network_gbs}  # None: not given
    try:
        nodes = sorted({int(n) for n in args.nodes.split(",")})  # the table's and picture's order
    except ValueError:
        parser.error(f"--nodes takes node counts such as 1,2,4, got {args.nodes!r}")
    if (
        min(nodes) < 1
        or args.gpus_per_node < 1
        or not _positive(*[v for v in gbs.values() if v is not None])
    ):
        parser.error("--nodes, --gpus_per_node and the bandwidths must be positive and finite")
    if args.output:
        try:
            compare_runs.check_output(Path(args.output))
        except compare_runs.CompareError as exc:
            parser.error(str(exc))
    links = Links(**{name: value for name, value in gbs.items() if value is not None})
    if args.preflight:
        links = preflight_links(args.preflight, links, parser)
        both = [f"--{name}_gbs" for name in links.measured if gbs[name] is not None]
        if both:
            parser.error(f"{both[0]} or --preflight {args.preflight}, which measured it: not both")
    try:
        pair = [job_of(run) for run in runs]
        pair = [replace(job, reduce=args.reduce_dtype or job.reduce) for job in pair]
        check_pair(runs)
    except (KeyError, TypeError, ZeroDivisionError) as exc:  # a run record without its flags
        parser.error(f"{runs[0]} or {runs[1]}: a run record without its model flags ({exc!r})")
    except ValueError as exc:
        parser.error(str(exc))
    found = scales(*pair, nodes, args.gpus_per_node, links)
    print(table(found, args.gpus_per_node))
    print(links_line(links, args.preflight))
    if args.output:
        picture(found, args.output)
        print(f"picture: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
